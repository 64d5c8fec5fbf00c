"""What the tests and the benchmarks both drive the server with: real uvicorn processes, the
``/metrics`` text read back, and checks of the engine's batch pipeline. Not part of the
server: nothing under ``app/`` imports it."""
