"""The recipe's checkpoint event sink: every rank logs, rank 0 reports to the agent (one copy per event)."""

import pytest

from elastictrain.agent.agent import _HeartbeatChannel
from elastictrain.runtime.checkpointing import event_sink
from elastictrain.runtime.heartbeat import Heartbeat


@pytest.fixture
def channel():
    ch = _HeartbeatChannel()
    yield ch
    ch.close()


def test_rank_0_reports_checkpoint_events_to_the_agent_with_millisecond_durations(channel):
    hb = Heartbeat(channel.addr, rank=0)
    event_sink(hb, rank=0)("checkpoint_saved", {"step": 10, "url": "u", "blocking_s": 0.0123456,
                                                 "total_s": 2.0004, "bytes": 1000})
    [ev] = channel.drain()[1]
    assert (ev.kind, ev.rank) == ("checkpoint_saved", 0)
    assert ev.fields == {"step": 10, "url": "u", "blocking_s": 0.012, "total_s": 2.0, "bytes": 1000}
    hb.close()


def test_other_ranks_only_log_what_rank_0_reports(channel, caplog):
    hb = Heartbeat(channel.addr, rank=1)
    with caplog.at_level("DEBUG", logger="elastictrain.runtime.checkpointing"):
        event_sink(hb, rank=1)("checkpoint_saved", {"step": 10})
    assert channel.drain() == ([], [])
    assert "checkpoint_saved" in caplog.text
    hb.close()
