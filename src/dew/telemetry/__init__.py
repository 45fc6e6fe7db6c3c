"""Measuring runs: profiler captures (`dew.telemetry.profile`)."""
