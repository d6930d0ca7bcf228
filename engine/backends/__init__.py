"""The backends that run a scheduled batch: torch (CPU, CUDA) and the RTX 4090 twin."""
