"""When an agent whose workers grow a shrunk round back may call them joined (agent/shrink.py `joined`): only once one
reported a phase past `init`. Every worker beats `init` at step 0 as it starts; taking that for "joined" left a grow
pending at the job's end waiting for the exit barrier's 300 s (the CI run that found it)."""

from elastictrain.agent.health import HealthConfig, HealthMonitor
from elastictrain.agent.shrink import joined
from elastictrain.runtime.heartbeat import Beat


def _workers(*phases: str) -> list:
    m = HealthMonitor(HealthConfig())
    m.reset({r: 100 + r for r in range(len(phases))}, now=0.0)
    for r, phase in enumerate(phases):
        if phase:
            m.record(Beat(local_rank=r, pid=100 + r, step=0, phase=phase, time=1.0), now=1.0)
    return list(m.workers.values())


def test_workers_that_only_started_have_not_joined() -> None:
    assert not joined(_workers("", ""))
    assert not joined(_workers("init", "init")), "the start-up beat (step 0) is not a sign of the group"


def test_a_worker_loading_or_training_has_joined() -> None:
    assert joined(_workers("init", "load"))
    assert joined(_workers("train"))
    assert joined(_workers("paused"))
