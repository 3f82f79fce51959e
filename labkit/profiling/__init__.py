"""Profiling and debugging: the profiler, reading traces, the roofline, the OOM playbook, collective benchmarks, hangs."""
