"""Straggler naming from per-rank step timings (elastictrain/runtime/stragglers.py), driven with plain numbers."""

import random

from elastictrain.runtime.stragglers import StragglerConfig, StragglerWatch

STEP = 0.2


def feed(watch: StragglerWatch, steps: range, late: dict[int, tuple[float, float]], noise: float = 0.005,
         seed: int = 0):
    """Per step: every rank's prelude and busy time with jitter; `late`: rank -> (extra prelude, extra busy)."""
    rng = random.Random(seed)
    changes = []
    for step in steps:
        prelude = [0.01 + rng.uniform(0, noise) + late.get(r, (0, 0))[0] for r in range(watch.world_size)]
        # Everyone waits for a late prelude inside the model's collectives, so it shows in nobody's busy time.
        wait = max(late.get(r, (0, 0))[0] for r in range(watch.world_size))
        busy = [STEP + wait + rng.uniform(0, noise) + late.get(r, (0, 0))[1] for r in range(watch.world_size)]
        changes += watch.observe(step, prelude, busy, STEP + wait + max(v[1] for v in late.values()) if late else STEP)
    return changes


def test_a_rank_slow_before_its_forward_is_named_after_the_configured_steps_and_cleared_when_it_recovers():
    w = StragglerWatch(4)
    assert feed(w, range(0, 19), {2: (0.08, 0.0)}) == [], "not before 20 slow steps in a row"
    [named] = feed(w, range(19, 20), {2: (0.08, 0.0)})
    assert named.rank == 2 and named.slow and named.step == 19 and 0.07 < named.lateness_s < 0.09
    assert 0.2 < named.score < 0.4, "lateness over the median step time (0.28 s)"
    assert feed(w, range(20, 60), {2: (0.08, 0.0)}) == [], "named once"
    assert set(w.slow) == {2}
    cleared = feed(w, range(60, 80), {})
    assert [(c.rank, c.slow, c.step) for c in cleared] == [(2, False, 79)]
    assert w.slow == {}


def test_a_rank_whose_compute_is_slow_is_named_by_its_late_arrival():
    w = StragglerWatch(3)
    changes = feed(w, range(40), {0: (0.0, 0.1)})
    assert [(c.rank, c.slow) for c in changes] == [(0, True)]


def test_jitter_and_a_rare_slow_step_name_nobody():
    w = StragglerWatch(8)
    assert feed(w, range(200), {}, noise=0.03) == []
    for step in range(200, 400):  # rank 5 is late one step in ten: never 20 in a row
        late = {5: (0.2, 0.0)} if step % 10 == 0 else {}
        assert feed(w, range(step, step + 1), late, seed=step) == []


def test_lateness_below_the_floor_is_not_a_straggler_on_very_short_steps():
    w = StragglerWatch(2, StragglerConfig(min_lateness_s=0.02))
    changes = []
    for step in range(50):  # 10 ms steps, rank 1 always 5 ms late: 50 % of the step, but timer noise
        changes += w.observe(step, [0.0, 0.005], [0.01, 0.01], 0.01)
    assert changes == []
