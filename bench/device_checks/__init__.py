"""The checks `python -m bench.device_check` runs on a lent GPU (bench/device_check.py says what and why)."""
