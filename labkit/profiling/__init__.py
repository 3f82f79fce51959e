"""Profiling and debugging: the profiler, reading traces, the OOM playbook, collective benchmarks, hangs."""
