"""In-memory snapshots restored at another world size (checkpoint/snapshot_reshard.py), with real processes: FSDP2
over gloo with uneven (and, at 3 ranks, empty) shards, the real `StateCheckpointer`, replica servers on loopback.

Snapshots taken at 2 ranks are restored at 1 (a node lost: its ranks' slots are replicas on the survivor) and at 3 (a
node added: its rank receives the ranges it needs of an old slot from a rank on a holder's node, over the process
group); taken at 1 and at 3, restored at 2. Each
restore must give the full (gathered) parameters and optimizer state of the save bitwise, the step, the learning rate
and the data position, and the new ranks must plan exactly the next global batch, once. A corrupt slot makes every
rank fall back to the durable checkpoint, with the reason in the skip event.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from elastictrain.checkpoint.replica_server import ReplicaServer
from elastictrain.checkpoint.replica_wire import REPLICAS_DIR, PeerList, committed_markers
from elastictrain.runtime.cursor import GlobalOrder
from elastictrain.testing.ranks import run_ranks
from tests.integration.checkpoint.dist_worker import REPO, free_port
from tests.integration.checkpoint.snapshot_reshard_worker import GLOBAL_BATCH, NUM_SAMPLES, SEED

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _launch(out: Path, nodes: list[Path], args: dict[str, Any]) -> list[dict[str, Any]]:
    """Run `args["scenario"]` with one rank per entry of `nodes` (the node folder it runs on); each rank's result."""
    out.mkdir(parents=True, exist_ok=True)
    per_node: dict[Path, int] = {}
    local_ranks = []
    for n in nodes:
        local_ranks.append(per_node.get(n, 0))
        per_node[n] = local_ranks[-1] + 1
    args = {**args, "out": str(out), "roots": [str(n) for n in nodes], "local_ranks": local_ranks}
    (out / "args.json").write_text(json.dumps(args))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    port, world = free_port(), len(nodes)
    codes = run_ranks(lambda r: [sys.executable, "-m", "tests.integration.checkpoint.snapshot_reshard_worker", str(r),
                                 str(world), str(port), str(out / "args.json")], world, out, 240, env=env, cwd=REPO)
    for r, code in enumerate(codes):
        assert code == 0, f"rank {r} exited {code}:\n" + (out / f"rank{r}.log").read_text()[-4000:]
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(world)]


class Nodes:
    """Node folders under one directory, each with a replica server on loopback (its agent's), and `peers.json`."""

    def __init__(self, base: Path, names: str):
        self.base, self.servers = base, {}
        for name in names:
            (base / name).mkdir(parents=True)
            self.servers[name] = ReplicaServer(base / name, "127.0.0.1", name, f"token-{name}")

    def __getitem__(self, name: str) -> Path:
        return self.base / name

    def replicate(self, source: str, to: str) -> None:
        """What the agents' ring does: the source node's rank folders, as replicas on the other node."""
        for rank_dir in sorted(self[source].glob("rank*")):
            shutil.copytree(rank_dir, self[to] / REPLICAS_DIR / source / rank_dir.name)

    def group(self, names: str) -> None:
        """The nodes of the group that restores: each one's agent lists them (the others are gone)."""
        for name in names:
            PeerList(name, [self.servers[n].peer() for n in names]).write(self[name])

    def close(self) -> None:
        for s in self.servers.values():
            s.close()


@pytest.fixture
def nodes(tmp_path):
    made: list[Nodes] = []
    yield lambda names: made.append(Nodes(tmp_path / f"nodes{len(made)}", names)) or made[-1]
    for n in made:
        n.close()


def _save(tmp_path: Path, name: str, on: list[Path]) -> tuple[dict[str, Any], str]:
    url = str(tmp_path / f"ckpt-{name}")
    results = _launch(tmp_path / name, on, {"scenario": "save", "url": url})
    return results[0], url


def _assert_resumed_as_saved(results: list[dict[str, Any]], saved: dict[str, Any], old_world: int,
                             fetched: int) -> None:
    assert all(r["resumed"] == "snapshot:step-3" and r["reseed"] for r in results), [r["resumed"] for r in results]
    for r in results:
        assert r["digest"] == saved["digest"], "full parameters and optimizer state must be the saved ones, bitwise"
        for key in ("step", "samples_consumed", "lr", "scheduler", "param_groups"):
            assert r[key] == saved[key], (key, r[key], saved[key])
    planned = [s for r in results for s in r["next_samples"]]
    order = GlobalOrder(NUM_SAMPLES, seed=SEED)
    assert sorted(planned) == sorted(order.lookup(range(3 * GLOBAL_BATCH, 4 * GLOBAL_BATCH))), \
        "the new ranks together plan the next global batch, each sample once"
    loaded = [f for name, f in results[0]["events"] if name == "checkpoint_snapshot_loaded"]
    assert loaded and loaded[0]["resharded_from"] == old_world and loaded[0]["durable_step"] == 2, loaded
    assert loaded[0]["fetched_slots"] == fetched, loaded
    assert loaded[0]["fetched_over_group"] == fetched, loaded
    assert not [e for e in results[0]["events"] if e[0] == "checkpoint_snapshot_skipped"]
    assert all(r["durable_step"] == 2 for r in results)


def _timing(results: list[dict[str, Any]]) -> str:
    restore, durable = (max(r[k] for r in results) for k in ("restore_s", "durable_load_s"))
    return f"snapshot restore {restore:.2f}s, durable load {durable:.2f}s"


def test_snapshots_of_two_ranks_restore_at_one_and_at_three_and_a_corrupt_slot_falls_back(tmp_path, nodes):
    n = nodes("abc")
    saved, url = _save(tmp_path, "save2", [n["a"], n["b"]])
    n.replicate("a", to="b")
    n.replicate("b", to="a")

    n.group("a")  # node b lost: a holds rank 0's slots and b's replica of rank 1
    one = _launch(tmp_path / "restore1", [n["a"]], {"scenario": "restore", "url": url})
    _assert_resumed_as_saved(one, saved, old_world=2, fetched=0)

    n.group("ac")  # node c joins a (b lost): c's rank 2 holds rows of old rank 1 only, copied from a's agent
    three = _launch(tmp_path / "restore3", [n["a"], n["a"], n["c"]], {"scenario": "restore", "url": url})
    _assert_resumed_as_saved(three, saved, old_world=2, fetched=1)
    loaded = next(f for name, f in three[0]["events"] if name == "checkpoint_snapshot_loaded")
    assert loaded["from_nodes"] == ["a"]
    assert loaded["fetched_bytes"] > 0 and loaded["fetched_in_place_bytes"] == 0, "items this small: into a buffer"
    print(f"2 -> 1: {_timing(one)}; 2 -> 3: {_timing(three)}")

    newest = max(committed_markers(n["a"] / REPLICAS_DIR / "b" / "rank1"), key=lambda m: m["step"])
    with open(n["a"] / REPLICAS_DIR / "b" / "rank1" / f"slot{newest['slot']}.bin", "r+b") as f:
        f.seek(7)
        f.write(b"\x5a")
    n.group("a")
    (fallback,) = _launch(tmp_path / "restore1-corrupt", [n["a"]], {"scenario": "restore", "url": url})
    assert not fallback["resumed"].startswith("snapshot:"), fallback["resumed"]
    assert fallback["step"] == 2 and fallback["samples_consumed"] == 2 * GLOBAL_BATCH
    (skipped,) = [f for name, f in fallback["events"] if name == "checkpoint_snapshot_skipped"]
    assert skipped["step"] == 3 and "corrupt" in skipped["reason"], skipped


@pytest.mark.parametrize("old", ["a", "aab"], ids=["1-to-2", "3-to-2"])
def test_snapshots_of_one_or_three_ranks_restore_at_two(tmp_path, nodes, old):
    n = nodes("abc")
    saved, url = _save(tmp_path, "save", [n[x] for x in old])
    if old == "aab":
        n.replicate("a", to="b")
        n.replicate("b", to="a")
        n.group("a")  # node b lost: both new ranks on a, which holds every old slot
        new, fetched = [n["a"], n["a"]], 0
    else:
        n.group("ac")  # node c joins: its rank receives the rows it owns of old rank 0's slot from a's rank
        new, fetched = [n["a"], n["c"]], 1
    # 1 -> 2: every item received straight into the state (the 2 -> 3 restore above goes through a buffer).
    results = _launch(tmp_path / "restore", new, {"scenario": "restore", "url": url, "in_place_min": 1})
    _assert_resumed_as_saved(results, saved, old_world=len(old), fetched=fetched)
    if fetched:
        loaded = next(f for name, f in results[0]["events"] if name == "checkpoint_snapshot_loaded")
        slot = max(committed_markers(n["a"] / "rank0"), key=lambda m: m["step"])
        # Rank 1's rows only, each tensor's in its own message: not rank 0's rows, nor the gaps between tensors.
        assert 0 < loaded["fetched_bytes"] < slot["nbytes"] // 2 + 64, \
            f"only the rows rank 1 owns move: {loaded['fetched_bytes']} of the slot's {slot['nbytes']} bytes"
        assert loaded["fetched_in_place_bytes"] == loaded["fetched_bytes"], loaded
    print(f"{len(old)} -> 2: {_timing(results)}")
