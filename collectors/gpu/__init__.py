"""NVML telemetry, hardware counters and the NVML event thread, per GPU."""
