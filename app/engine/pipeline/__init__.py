"""The device path of a batch: streams and events, per-batch slots, collation, CUDA graphs."""
