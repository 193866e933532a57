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


def test_a_named_rank_still_slow_for_the_confirm_steps_is_confirmed_once_and_a_fast_step_restarts_the_count():
    w = StragglerWatch(4, StragglerConfig(confirm_steps=5))
    [named] = feed(w, range(0, 20), {1: (0.08, 0.0)})
    assert named.slow and not named.confirmed and named.step == 19
    assert feed(w, range(20, 24), {1: (0.08, 0.0)}) == [], "not before 5 more slow steps"
    assert feed(w, range(24, 25), {}) == [], "a fast step: the rank may be recovering"
    assert feed(w, range(25, 29), {1: (0.08, 0.0)}) == []
    [confirmed] = feed(w, range(29, 30), {1: (0.08, 0.0)})
    assert (confirmed.rank, confirmed.slow, confirmed.confirmed, confirmed.step) == (1, True, True, 29)
    assert 0.07 < confirmed.lateness_s < 0.09
    assert feed(w, range(30, 60), {1: (0.08, 0.0)}) == [], "confirmed once per naming"
    assert set(w.slow) == {1}


def test_without_confirm_steps_a_straggler_is_only_named():
    w = StragglerWatch(2)
    assert [(c.slow, c.confirmed) for c in feed(w, range(100), {0: (0.1, 0.0)})] == [(True, False)]


def test_confirm_steps_come_from_the_agents_environment(monkeypatch):
    from elastictrain.runtime.stragglers import ENV_CONFIRM_STEPS, config_from_env

    monkeypatch.delenv(ENV_CONFIRM_STEPS, raising=False)
    assert config_from_env().confirm_steps == 0
    monkeypatch.setenv(ENV_CONFIRM_STEPS, "7")
    assert config_from_env().confirm_steps == 7
    monkeypatch.setenv(ENV_CONFIRM_STEPS, "seven")
    assert config_from_env().confirm_steps == 0


def test_the_margin_and_the_steps_come_from_the_agents_settings(monkeypatch):
    """elastic.straggler_margin / straggler_steps: a rank 30% late is named at the default 20% margin, not at 50%;
    with 5 steps it is named after 5."""
    from elastictrain.agent.job import _straggler_replacer
    from elastictrain.config import ElasticConfig
    from elastictrain.runtime.stragglers import ENV_MARGIN, ENV_STEPS, config_from_env

    for name in (ENV_MARGIN, ENV_STEPS):
        monkeypatch.delenv(name, raising=False)
    assert (config_from_env().margin, config_from_env().steps) == (0.2, 20)
    late = {1: (0.09, 0.0)}  # 0.09 s on a 0.3 s median step
    assert [c.rank for c in feed(StragglerWatch(3, config_from_env()), range(40), late)] == [1]
    # What the agent does with its settings (replace_stragglers off: only the rule is passed on).
    assert _straggler_replacer(ElasticConfig(straggler_margin=0.5, straggler_steps=5), None, "", 1, None,
                               lambda: None, lambda *_: None) is None
    assert (config_from_env().margin, config_from_env().steps) == (0.5, 5)
    assert feed(StragglerWatch(3, config_from_env()), range(40), late) == [], "30% late is within a 50% margin"
    monkeypatch.setenv(ENV_MARGIN, "0.2")
    [named] = feed(StragglerWatch(3, config_from_env()), range(5), late)
    assert named.rank == 1 and named.step == 4, "named after 5 slow steps"
    monkeypatch.setenv(ENV_STEPS, "often")
    assert config_from_env().steps == 20, "an unreadable value falls back to the default"


def test_a_wrong_margin_or_step_count_is_refused_naming_the_setting():
    import pytest

    from elastictrain.config import load_config
    from elastictrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"elastic.straggler_margin must be in \(0, 10\]"):
        load_config(None, ["elastic.straggler_margin=0"])
    with pytest.raises(ConfigError, match="elastic.straggler_steps must be >= 1"):
        load_config(None, ["elastic.straggler_steps=0"])
    assert load_config(None, ["elastic.straggler_margin=0.5"]).elastic.straggler_margin == 0.5
