"""The snapshot memory budget (checkpoint/snapshot_budget.py, `checkpoint.snapshot_memory`): a node whose snapshots
do not fit in the budget or in the free space of the file system that holds them stops before its first snapshot
with one line naming the numbers and the fix; one whose snapshots fit goes on. Real `statvfs` on a temp directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from elastictrain.checkpoint import snapshot_budget
from elastictrain.checkpoint.snapshot import SnapshotStore
from elastictrain.checkpoint.snapshot_budget import (
    PLAN_FILE,
    check_snapshot_budget,
    host_memory_bytes,
    ram_per_state_gb,
)
from elastictrain.checkpoint.snapshot_folders import bytes_held
from elastictrain.config import load_config, parse_memory_size
from elastictrain.errors import ConfigError

MiB = 1 << 20
JOB = {"run": "r1", "fingerprint": {"model": "abc"}, "world_size": 2, "url": "file:///ck"}


def test_a_budget_too_small_for_two_slots_per_rank_stops_with_the_numbers_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as e:
        check_snapshot_budget(100 * MiB, local_ranks=2, budget="300MiB", folder=tmp_path, replica=False)
    msg = str(e.value)
    assert "need 419430400 bytes" in msg and "2 slots x 2 local rank(s) x 100.00 MiB" in msg
    assert "checkpoint.snapshot_memory allows 314572800 bytes" in msg and "set to 300MiB" in msg
    assert "raise checkpoint.snapshot_memory" in msg and "fewer ranks per node" in msg
    assert "checkpoint.snapshot_every_steps=0" in msg
    assert "--shm-size" not in msg  # the file system has room: only the budget is short
    assert not e.value.restartable  # a restart cannot make it fit: the job stops with the message
    assert "\n" not in msg


def test_a_peer_replica_needs_two_more_slots_per_rank(tmp_path):
    check_snapshot_budget(100 * MiB, local_ranks=1, budget="250MiB", folder=tmp_path, replica=False)
    with pytest.raises(ConfigError, match=r"need 419430400 bytes .*\(2 slots \+ a peer node's replica\)"):
        check_snapshot_budget(100 * MiB, local_ranks=1, budget="250MiB", folder=tmp_path, replica=True)


def test_snapshots_larger_than_the_free_space_stop_even_within_the_budget(tmp_path):
    fs = os.statvfs(tmp_path)
    per_rank = fs.f_bavail * fs.f_frsize // 2 + (1 << 30)  # two slots: 2 GiB more than is free
    with pytest.raises(ConfigError) as e:
        check_snapshot_budget(per_rank, local_ranks=1, budget="1000TiB", folder=tmp_path, replica=False)
    msg = str(e.value)
    assert f"need {2 * per_rank} bytes" in msg and f"the file system under {tmp_path} has" in msg
    assert "free" in msg and "docker run --shm-size" in msg and "checkpoint.snapshot_every_steps=0" in msg
    assert "raise checkpoint.snapshot_memory" not in msg  # the budget is not what is short


def test_snapshots_that_fit_pass_and_the_budget_counts_exactly_what_the_store_writes(tmp_path):
    state = {"model": {"w": torch.zeros(1000, 250)}, "optim": {"m": torch.zeros(1000, 500)}, "step": 3}
    per_rank = (1000 * 250 + 1000 * 500) * 4
    for rank in (0, 1):
        store = SnapshotStore(tmp_path, rank, JOB)
        for step in (1, 2, 3):
            store.save(step, state)
        store.close()
    written = sum(p.stat().st_size for p in tmp_path.glob("rank*/slot*.bin"))
    plan = check_snapshot_budget(per_rank, local_ranks=2, budget=written, folder=tmp_path, replica=False)
    assert plan.needed == written == 2 * 2 * per_rank
    with pytest.raises(ConfigError):
        check_snapshot_budget(per_rank, local_ranks=2, budget=written - 1, folder=tmp_path, replica=False)
    # A restarted worker checks again with its slots already written: they count as room, not as used.
    assert bytes_held(tmp_path) >= written


def test_the_default_budget_is_half_of_the_file_system_and_a_fraction_is_of_the_nodes_ram(tmp_path):
    fs = os.statvfs(tmp_path)
    plan = check_snapshot_budget(1, local_ranks=1, budget=None, folder=tmp_path, replica=False)
    assert plan.budget == fs.f_blocks * fs.f_frsize // 2 and "unset: 0.5 of the" in plan.budget_from
    plan = check_snapshot_budget(1, local_ranks=1, budget="0.25", folder=tmp_path, replica=False)
    assert plan.budget == int(host_memory_bytes() * 0.25) and 0 < host_memory_bytes() <= os.sysconf(
        "SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_ram_each_node_needs_per_gb_of_train_state():
    assert ram_per_state_gb() == 2.0  # one node: two slots of the whole state
    assert ram_per_state_gb(nodes=1, replica=True) == 4.0
    assert ram_per_state_gb(nodes=8, replica=True) == 4 / 8  # two slots of its eighth, two of a peer's eighth


@pytest.mark.parametrize("value, expected", [
    ("8GiB", 8 << 30), ("500MB", 500_000_000), ("1.5 GiB", 3 << 29), ("8589934592", 8 << 30),
    ("0.25", 0.25), ("1", 1.0),
])  # fmt: skip
def test_snapshot_memory_takes_sizes_bytes_and_fractions(value, expected):
    cfg = load_config(None, [f"checkpoint.snapshot_memory={value}"])
    assert parse_memory_size(cfg.checkpoint.snapshot_memory, "x") == expected


@pytest.mark.parametrize("value", ["0", "-1GiB", "1.5", "8g", "lots", "true", ".inf"])
def test_a_bad_snapshot_memory_names_the_field_and_the_fix(value):
    with pytest.raises(ConfigError, match=r"checkpoint\.snapshot_memory.*(8GiB|expected)"):
        load_config(None, [f"checkpoint.snapshot_memory={value}"])


# --- several agents on one host (two jobs, or the simulated nodes of a test) ------------------------------------

def _agent_folder(base, pid: int):
    """An agent's run folder as agent/snapshots.py names it: `<run>-<agent pid>`."""
    folder = base / f"job-{pid}"
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def live_pid():
    """The pid of a process that runs for the test (standing for another agent on the host)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _plenty_of_memory(monkeypatch):
    """These tests are about the file system's share; the host's free memory is the subject of the last one."""
    monkeypatch.setattr(snapshot_budget, "ram_available_bytes", lambda: 1 << 60)


@pytest.fixture
def shm_dir():
    """A folder on /dev/shm, where snapshots live (mostly free: the default budget, half of it, is the limit)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="et-budget-test-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_agents_on_one_host_share_the_default_budget_and_the_second_stops_naming_the_first(
        shm_dir, live_pid, monkeypatch):
    _plenty_of_memory(monkeypatch)
    base = shm_dir / "elastictrain-snapshots"
    first, second = _agent_folder(base, live_pid), _agent_folder(base, os.getpid())
    fs = os.statvfs(shm_dir)
    share = fs.f_blocks * fs.f_frsize // 2
    per_rank = share * 6 // 10 // 2  # each node's two slots take 0.6 of the default budget: one node fits, not two
    if fs.f_bavail * fs.f_frsize < 4 * per_rank:
        pytest.skip("/dev/shm is more than half full")
    plan = check_snapshot_budget(per_rank, local_ranks=1, budget=None, folder=first, replica=False)
    assert plan.budget == share and not plan.others
    assert json.loads((first / PLAN_FILE).read_text()) == {"needed": 2 * per_rank}  # nothing written yet but this
    with pytest.raises(ConfigError) as e:
        check_snapshot_budget(per_rank, local_ranks=1, budget=None, folder=second, replica=False)
    msg = str(e.value)
    assert f"allows {share - 2 * per_rank} bytes" in msg and "less" in msg and "1 other agent(s) on this host" in msg
    assert "other agents on this host plan" in msg and first.name in msg and "run fewer nodes or jobs per host" in msg
    # An explicit budget is this node's own; the free space still counts what the first agent will write.
    plan = check_snapshot_budget(per_rank, local_ranks=1, budget=2 * per_rank, folder=second, replica=False)
    assert plan.available <= fs.f_bavail * fs.f_frsize - 2 * per_rank + bytes_held(second)
    assert [o.path for o in plan.others] == [first]


def test_the_folder_of_a_gone_agent_is_not_counted(tmp_path, monkeypatch):
    _plenty_of_memory(monkeypatch)
    gone = subprocess.Popen(["true"])
    gone.wait()
    base = tmp_path / "elastictrain-snapshots"
    dead, mine = _agent_folder(base, gone.pid), _agent_folder(base, os.getpid())
    (dead / PLAN_FILE).write_text(json.dumps({"needed": 1 << 50}))
    plan = check_snapshot_budget(MiB, local_ranks=1, budget=None, folder=mine, replica=False)
    assert not plan.others and "less" not in plan.budget_from


def test_slots_another_agent_planned_but_has_not_written_count_against_the_hosts_free_memory(tmp_path, live_pid):
    free = snapshot_budget.ram_available_bytes()
    assert free is not None and free > 0  # /proc/meminfo: MemAvailable
    base = tmp_path / "elastictrain-snapshots"
    first, second = _agent_folder(base, live_pid), _agent_folder(base, os.getpid())
    # The first agent passed its check when the memory was free, and has not written its slots yet.
    (first / PLAN_FILE).write_text(json.dumps({"needed": free}))
    with pytest.raises(ConfigError) as e:
        check_snapshot_budget(64 * MiB, local_ranks=1, budget="1TiB", folder=second, replica=True)
    msg = str(e.value)
    assert "of memory free for the" in msg and "MemAvailable, less what other agents planned" in msg
    assert "free memory on the host" in msg and first.name in msg and "\n" not in msg
    assert not (second / PLAN_FILE).exists()  # a node that does not fit claims nothing


CHECKER = """
import sys
from pathlib import Path
from elastictrain.checkpoint import snapshot_budget
from elastictrain.errors import ConfigError
snapshot_budget.ram_available_bytes = lambda: 1 << 60  # the file system's share is the subject here
folder = Path(sys.argv[1]) / f"job-{__import__('os').getpid()}"
folder.mkdir(parents=True)
print("ready", flush=True)
try:
    snapshot_budget.check_snapshot_budget(int(sys.argv[2]), local_ranks=1, budget=None, folder=folder, replica=False)
    print("fits", flush=True)
except ConfigError as e:
    print("refused", e, flush=True)
sys.stdin.readline()  # an agent stays alive while its job runs: its plan counts for the others until then
"""


def test_two_agents_checking_at_once_take_turns_so_only_one_claims_the_share(shm_dir):
    """Two agents starting together (the nodes of one host, two jobs) each check their snapshots against the
    default budget they share: under the lock on the snapshot base one checks after the other and sees its plan, so
    exactly one of two nodes that fit only alone goes on. Real processes; while the lock is held (here by the test,
    as by an agent mid-check) neither gets past it."""
    import fcntl
    import sys
    import time

    base = shm_dir / "elastictrain-snapshots"
    base.mkdir()
    fs = os.statvfs(shm_dir)
    per_rank = fs.f_blocks * fs.f_frsize // 2 * 6 // 10 // 2
    if fs.f_bavail * fs.f_frsize < 4 * per_rank:
        pytest.skip("/dev/shm is more than half full")
    fd = os.open(base / snapshot_budget._LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    procs = []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-c", CHECKER, str(base), str(per_rank)], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(2)]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n", p.stderr.read() if p.stderr else ""
        time.sleep(1.0)
        assert [p.poll() for p in procs] == [None, None]  # both wait for the lock
        assert not list(base.glob(f"*/{PLAN_FILE}"))
        os.close(fd)  # releases the lock: the two race for it
        fd = -1
        outs = [p.stdout.readline() for p in procs if p.stdout is not None]  # both checked, both still alive
        for p in procs:
            p.communicate("\n", timeout=120)
    finally:
        if fd >= 0:
            os.close(fd)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(o.split()[0] for o in outs) == ["fits", "refused"], outs
    refused = next(o for o in outs if o.startswith("refused"))
    assert "1 other agent(s) on this host" in refused
    assert len(list(base.glob(f"*/{PLAN_FILE}"))) == 1  # only the node that fits claims its share
