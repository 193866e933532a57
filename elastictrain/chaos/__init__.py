"""Chaos for tests, benchmarks and `elastictrain chaos`, one module per concern.

``schedule`` (the fault schedule and its ``ScheduledFault``), ``runner`` (fires a schedule into a ``ChaosTarget``),
``injectors`` (one per scheduled fault kind, each returning what it did and how to heal it), ``local`` (a live job
on this machine as a target), ``process_signals`` (find and signal a launcher's processes by PID) and
``in_worker`` (faults a worker injects into itself, chosen by ``ELASTICTRAIN_CHAOS``).
"""
