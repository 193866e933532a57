"""Schedule grammar: parsing, describe() round trips, errors that name the bad token, seeded random schedules."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictrain.chaos.schedule import DEFAULT_DURATIONS, KINDS, NODE_KINDS, WORKER_KINDS, Schedule, ScheduledFault
from elastictrain.errors import ConfigError


def test_parses_the_agreed_example():
    s = Schedule.parse("kill-worker@step=50, partition:node2@t=120s/10s", seed=3)
    assert s.seed == 3
    assert s.faults == [
        ScheduledFault("kill-worker", at_step=50),
        ScheduledFault("partition", target="node2", at_time=120.0, duration=10.0),
    ]


def test_separators_units_and_rank():
    s = Schedule.parse("kill-worker:node1#1@step=40; stop-worker#3@t=500ms/2m\nstorage-full/1.5s")
    assert s.faults == [
        ScheduledFault("kill-worker", target="node1", rank=1, at_step=40),
        ScheduledFault("stop-worker", rank=3, at_time=0.5, duration=120.0),
        ScheduledFault("storage-full", duration=1.5),
    ]


@pytest.mark.parametrize("text", [
    "kill-worker@step=50", "partition:node2@t=120s/10s", "kill-worker:node1#1@step=40", "stop-worker#0@t=0.5s/3s",
    "restart-etcd@t=30s", "corrupt-checkpoint@step=12", "drain-node", "kill-node:n-1.a@step=8/3s",
])
def test_describe_round_trips(text):
    fault = ScheduledFault.parse(text)
    assert fault.describe() == text
    assert ScheduledFault.parse(fault.describe()) == fault


@pytest.mark.parametrize("text,named", [
    ("kill-worker@step=50, explode@t=3s", "explode"),
    ("kill-worker@stp=5", "kill-worker@stp=5"),
    ("storage-down:node1", ":node1"),
    ("kill-node#2", "#2"),
    ("kill-worker@step=5/3s", "/duration"),
    ("stop-worker@t=abc", "stop-worker@t=abc"),
])
def test_errors_name_the_bad_token(text, named):
    with pytest.raises(ConfigError) as e:
        Schedule.parse(text)
    assert named in str(e.value)


def test_empty_schedule_is_an_error_that_shows_the_grammar():
    with pytest.raises(ConfigError, match="KIND"):
        Schedule.parse(" , ;\n")


def test_heal_after_uses_kind_default():
    assert ScheduledFault("stop-worker").heal_after == DEFAULT_DURATIONS["stop-worker"]
    assert ScheduledFault("stop-worker", duration=2.0).heal_after == 2.0
    assert ScheduledFault("kill-worker").heal_after is None


def test_random_same_seed_same_schedule():
    a = Schedule.random(7, 20)
    assert a == Schedule.random(7, 20)
    assert a.describe() != Schedule.random(8, 20).describe()
    assert len(a.faults) == 20 and a.seed == 7
    times = [f.at_time for f in a.faults]
    assert times == sorted(times) and times[0] >= 10.0 * 0 and all(f.target is None for f in a.faults)


def test_random_respects_kinds_and_spacing():
    s = Schedule.random(1, 10, kinds=("kill-worker", "stop-worker"), start_s=5.0, every_s=10.0, jitter=0.2)
    assert {f.kind for f in s.faults} <= {"kill-worker", "stop-worker"}
    for i, f in enumerate(s.faults):
        assert abs(f.at_time - (5.0 + 10.0 * i)) <= 2.0 + 0.05


def test_random_rejects_unknown_kind():
    with pytest.raises(ConfigError, match="nope"):
        Schedule.random(1, 3, kinds=("nope",))


_times = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def faults(draw):
    kind = draw(st.sampled_from(KINDS))
    target = draw(st.none() | st.from_regex(r"[A-Za-z0-9_.\-]{1,8}", fullmatch=True)) if kind in NODE_KINDS else None
    rank = draw(st.none() | st.integers(0, 4096)) if kind in WORKER_KINDS else None
    trigger = draw(st.sampled_from(["none", "step", "time"]))
    at_step = draw(st.integers(0, 10**6)) if trigger == "step" else None
    at_time = draw(_times) if trigger == "time" else None
    duration = draw(st.none() | _times) if DEFAULT_DURATIONS[kind] is not None else None
    return ScheduledFault(kind, target, rank, at_step, at_time, duration)


@given(st.lists(faults(), min_size=1, max_size=6), st.integers(0, 2**32))
def test_any_schedule_round_trips_through_describe(fs, seed):
    s = Schedule(faults=fs, seed=seed)
    assert Schedule.parse(s.describe(), seed=seed) == s
