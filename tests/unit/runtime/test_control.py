"""Worker-side operator control: the control file and the doorbell (elastictrain/runtime/control.py)."""

import os
import signal

from elastictrain.runtime.control import ENV_CONTROL_FILE, ControlState, WorkerControl


def test_state_file_round_trips_and_a_missing_or_bad_file_reads_as_no_request(tmp_path):
    path = str(tmp_path / "control.json")
    assert ControlState.read(path) == ControlState()
    ControlState(paused=True, ckpt_seq=4).write(path)
    assert ControlState.read(path) == ControlState(paused=True, ckpt_seq=4)
    (tmp_path / "control.json").write_text("{not json")
    assert ControlState.read(path) == ControlState()


def test_worker_reads_the_file_only_after_the_doorbell_and_never_replays_an_old_checkpoint_request(
        tmp_path, monkeypatch):
    path = str(tmp_path / "control.json")
    ControlState(ckpt_seq=3).write(path)
    monkeypatch.setenv(ENV_CONTROL_FILE, path)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        ctl = WorkerControl.from_env()
        assert not ctl.ckpt_requested and not ctl.paused  # seq 3 predates this worker
        ControlState(paused=True, ckpt_seq=4).write(path)
        ctl.poll()
        assert not ctl.paused  # no doorbell yet: no file read
        os.kill(os.getpid(), signal.SIGUSR1)
        ctl.poll()
        assert ctl.paused and ctl.ckpt_requested
        ctl.ckpt_handled()
        assert not ctl.ckpt_requested
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_without_an_agent_control_is_inert():
    ctl = WorkerControl(None)
    ctl.poll()
    assert not ctl.paused and not ctl.ckpt_requested


def test_a_reform_request_is_seen_after_the_doorbell_and_one_older_than_the_worker_is_not(tmp_path, monkeypatch):
    path = str(tmp_path / "control.json")
    ControlState(reform_seq=2).write(path)
    monkeypatch.setenv(ENV_CONTROL_FILE, path)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        ctl = WorkerControl.from_env()
        assert not ctl.reform_requested, "the request that re-formed the group before this worker started"
        ControlState(reform_seq=3).write(path)
        os.kill(os.getpid(), signal.SIGUSR1)
        ctl.poll()
        assert ctl.reform_requested and not ctl.paused and not ctl.ckpt_requested
    finally:
        signal.signal(signal.SIGUSR1, previous)
