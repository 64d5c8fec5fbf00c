"""The gRPC front end: the Open Inference Protocol's ``inference.GRPCInferenceService`` (with
Triton's additions), ``grpc.health.v1.Health`` and server reflection, in the same process and
event loop as uvicorn, over the same serving core as the HTTP routes."""
