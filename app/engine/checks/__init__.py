"""What an engine must pass before it serves: the accuracy gate's measures, the start-up check
against eager fp32, and the measured choice of precision."""
