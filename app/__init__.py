"""batchserve's HTTP face: settings, routes, metrics and the model engine."""

import os

# torch's OpenMP threads (resizing and normalising images, a TorchScript forward pass) spin
# on their cores for a while after every parallel region by default: cores that the decode
# threads and the runtime's own threads need. Waiting passively served more images per second
# side by side (benchmarks/results/served-ab-omp-passive-*.md). libgomp reads this once, when
# torch loads it, so it is set here, before anything imports torch; a value in the
# environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
