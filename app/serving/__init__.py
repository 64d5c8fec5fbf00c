"""The serving core, the same for every front end: the model repository, the registry of
loaded model versions (load, reload, unload), admission, the prediction path and the process's
lifecycle. It knows nothing of HTTP or gRPC."""
