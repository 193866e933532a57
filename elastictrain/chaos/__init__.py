"""Chaos for tests, benchmarks and `elastictrain chaos`, one module per concern.

``schedule`` (the fault schedule and its ``ScheduledFault``), ``runner`` (fires a schedule into a ``ChaosTarget``),
``injectors`` (one per scheduled fault kind, each returning what it did and how to heal it), ``local`` (a live job
on this machine as a target), and ``process_signals`` (find and signal a launcher's processes by PID).
Faults a worker injects into itself (``ELASTICTRAIN_CHAOS``) live on the worker side, in
:mod:`elastictrain.runtime.injected_faults`.
"""
