"""`elastictrain ckpt ls` shows the in-memory snapshot tier of this node (cli/ckpt_snapshots.py): per run folder and
rank the committed steps and sizes and whether the owning agent is alive, read from snapshots written by the real
SnapshotStore, without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastictrain.checkpoint.snapshot import SnapshotStore
from elastictrain.checkpoint.snapshot_budget import PLAN_FILE, check_snapshot_budget
from elastictrain.checkpoint.snapshot_folders import bytes_held
from elastictrain.checkpoint.storage import open_storage
from elastictrain.cli.ckpt import human_bytes
from elastictrain.cli.main import main
from tests.unit.checkpoint.conftest import write_checkpoint

REPO = Path(__file__).resolve().parents[3]
STATE_BYTES = 300 * 4


def write_snapshots(folder: Path, url: str, ranks: int, steps: range) -> None:
    """What a node's workers leave in their agent's folder: each rank's newest two steps committed."""
    for rank in range(ranks):
        store = SnapshotStore(folder, rank, {"run": "job", "fingerprint": {"model": "abc"}, "world_size": ranks,
                                             "url": url})
        for step in steps:
            store.save(step, {"model": {"w": torch.full((300,), float(step))}, "step": step})
        store.close()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def ls(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["ckpt", "ls", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def base(tmp_path) -> Path:
    return tmp_path / "shm"


def test_ls_adds_the_jobs_snapshots_per_rank_with_steps_sizes_and_a_live_agent(capsys, tmp_path, base):
    root = tmp_path / "ckpts"
    write_checkpoint(open_storage(str(root)), 5)
    write_snapshots(base / f"job-{os.getpid()}", str(root), ranks=2, steps=range(1, 8))
    rc, out, _ = ls(capsys, str(root), "--snapshot-base", str(base))
    assert rc == 0
    durable, snapshots = out.split("\n\n")
    assert [ln.split()[:2] for ln in durable.splitlines()[2:]] == [["5", "valid"]]
    lines = snapshots.splitlines()
    assert lines[0] == f"in-memory snapshots on this node ({base})"
    assert lines[1].split() == ["FOLDER", "AGENT", "RANK", "STEP", "WORLD", "SIZE", "NOTE"]
    size = human_bytes(STATE_BYTES).split()
    me = [f"job-{os.getpid()}", str(os.getpid()), "alive"]
    assert [ln.split() for ln in lines[2:-1]] == [[*me, "0", "7", "2", *size], [*me, "0", "6", "2", *size],
                                                  [*me, "1", "7", "2", *size], [*me, "1", "6", "2", *size]]
    # The node's memory: what its folder holds, and what its last budget check planned (none ran here).
    held = bytes_held(base / f"job-{os.getpid()}")
    assert held >= 4 * STATE_BYTES
    assert lines[-1].startswith(f"job-{os.getpid()}: holds {human_bytes(held)}, planned - (its last budget check")


def test_ls_json_gives_each_ranks_committed_steps_bytes_and_a_dead_agent(capsys, tmp_path, base):
    root, pid = tmp_path / "ckpts", dead_pid()
    write_checkpoint(open_storage(str(root)), 5)
    folder = base / f"job-{pid}"
    write_snapshots(folder, f"file://{root}/", ranks=2, steps=range(1, 4))  # the same root, spelled otherwise
    (folder / "rank1" / "slot0.json").unlink()  # rank 1 died in the middle of its next save
    rc, out, _ = ls(capsys, str(root), "--snapshot-base", str(base), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [5]
    (f,) = doc["snapshots"]["folders"]
    assert (f["folder"], f["run"], f["agent_pid"], f["agent_alive"]) == (str(folder), "job", pid, False)
    held = {r["rank"]: [(s["step"], s["bytes"], s["world_size"]) for s in r["snapshots"]] for r in f["ranks"]}
    assert held == {0: [(3, STATE_BYTES, 2), (2, STATE_BYTES, 2)], 1: [(2, STATE_BYTES, 2)]}
    assert f["planned_bytes"] is None and f["held_bytes"] == bytes_held(folder)


def test_ls_shows_what_each_agents_budget_check_planned_for_its_node(capsys, tmp_path, base):
    """Several agents on one host share the snapshot budget (checkpoint/snapshot_budget.py): `ckpt ls` shows, per
    folder, what its last check planned (own slots and a peer's replicas) beside what it holds, the numbers a
    refused node's message compares."""
    root = tmp_path / "ckpts"
    folder = base / f"job-{os.getpid()}"
    write_snapshots(folder, str(root), ranks=1, steps=range(1, 3))
    plan = check_snapshot_budget(STATE_BYTES, local_ranks=1, budget="1MiB", folder=folder, replica=True)
    assert json.loads((folder / PLAN_FILE).read_text()) == {"needed": plan.needed}
    rc, out, _ = ls(capsys, str(root), "--snapshot-base", str(base), "--json")
    assert rc == 0
    (f,) = json.loads(out)["snapshots"]["folders"]
    assert f["planned_bytes"] == plan.needed and f["held_bytes"] == bytes_held(folder)
    rc, out, _ = ls(capsys, str(root), "--snapshot-base", str(base))
    assert out.splitlines()[-1].startswith(f"job-{os.getpid()}: holds {human_bytes(bytes_held(folder))}, planned "
                                           f"{human_bytes(plan.needed)} ")


def test_only_the_jobs_snapshots_show_unless_asked_for_every_folder(capsys, tmp_path, base):
    root, other = tmp_path / "ckpts", "s3://bucket/other-job"
    write_checkpoint(open_storage(str(root)), 5)
    write_snapshots(base / f"other-{os.getpid()}", other, ranks=1, steps=range(1, 3))
    (base / f"fresh-{os.getpid()}" / "rank0").mkdir(parents=True)  # before its first snapshot
    rc, out, _ = ls(capsys, str(root), "--snapshot-base", str(base))
    assert rc == 0 and "in-memory snapshots" not in out
    rc, out, _ = ls(capsys, str(root), "--snapshot-base", str(base), "--snapshots")
    rows = [ln.split() for ln in out.split("\n\n")[1].splitlines()[2:]]
    assert [r[0] for r in rows] == [f"fresh-{os.getpid()}", f"other-{os.getpid()}", f"other-{os.getpid()}",
                                    f"fresh-{os.getpid()}:", f"other-{os.getpid()}:"]  # then each one's memory
    assert rows[0][1:] == [str(os.getpid()), "alive", "0", "-", "-", "-", "nothing", "committed"]
    assert rows[1][3:5] == ["0", "2"] and rows[1][-3:] == ["job", "of", other]
    rc, out, _ = ls(capsys, str(root), "--snapshot-base", str(tmp_path / "none"), "--snapshots")
    assert rc == 0 and out.endswith(f"in-memory snapshots on this node ({tmp_path / 'none'}): none\n")


def test_snapshots_before_the_first_durable_save_list_with_a_note_not_an_error(capsys, tmp_path, base):
    root = tmp_path / "ckpts"
    write_snapshots(base / f"job-{os.getpid()}", str(root), ranks=1, steps=range(1, 3))
    rc, out, err = ls(capsys, str(root), "--snapshot-base", str(base))
    assert rc == 0 and not err
    assert out.startswith(f"file://{root}: no checkpoints at")
    assert out.split("\n\n")[1].splitlines()[2].split()[4] == "2"
    rc, _, err = ls(capsys, str(tmp_path / "elsewhere"), "--snapshot-base", str(base))
    assert rc == 2 and "no checkpoints" in err


def test_listing_the_snapshot_tier_imports_no_torch(tmp_path, base):
    root = tmp_path / "ckpts"
    write_snapshots(base / f"job-{os.getpid()}", str(root), ranks=1, steps=range(1, 3))
    probe = ("import json, sys\nfrom elastictrain.cli.main import main\n"
             f"rc = main(['ckpt', 'ls', {str(root)!r}, '--snapshot-base', {str(base)!r}, '--json'])\n"
             "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO,
                         check=True).stdout
    doc = json.loads(out[: out.rindex("}\n{") + 2])
    assert doc["snapshots"]["folders"][0]["ranks"][0]["snapshots"][0]["step"] == 2
    assert json.loads(out.strip().splitlines()[-1]) == {"rc": 0, "torch": False}
