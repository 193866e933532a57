"""Fault injectors for chaos tests and benchmarks: in-worker faults (``inject``) and process faults (``faults``)."""
