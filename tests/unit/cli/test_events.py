"""`elastictrain events` text output: checkpoint events read at a glance."""

from elastictrain.cli.events import readable
from elastictrain.cli.status import format_event


def test_checkpoint_saved_shows_step_seconds_and_a_human_size():
    e = {"time": 0.0, "node": "n1", "kind": "checkpoint_saved",
         "fields": {"group_rank": 0, "step": 20, "blocking_s": 0.012, "total_s": 1.5, "bytes": 734003200, "rank": 0}}
    line = format_event(readable(e))
    assert "n1  checkpoint_saved  " in line
    assert "step=20 blocking_s=0.012 total_s=1.5 bytes=700.0MiB rank=0" in line
    assert e["fields"]["bytes"] == 734003200  # the event itself (and --json) keeps the number


def test_events_without_a_size_are_unchanged():
    e = {"time": 0.0, "node": "n1", "kind": "join", "fields": {"world_size": 2}}
    assert readable(e) is e
