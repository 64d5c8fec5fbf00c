"""batchserve's HTTP face: settings, routes, metrics and the model engine."""
