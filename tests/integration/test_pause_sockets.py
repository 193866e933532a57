"""A paused survivor tells the peers blocked on it (runtime/inplace.py `shut_group_sockets`), with real gloo processes.

The case behind a CI flake of the 3-node in-place chaos test: rank 1 died, rank 0's collective failed and it paused,
but rank 2's collective waited on rank 0, not on rank 1. Rank 0's group stayed alive (FSDP references it, and gloo's
abort does not close a referenced group's connections), so rank 2 waited for its collective timeout and its agent
called it hung: the job restarted every worker instead of pausing in place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastictrain.rendezvous.embedded import free_port
from tests.integration.recipe_runs import REPO

pytestmark = [pytest.mark.timeout(120)]

RANK = textwrap.dedent('''
    import datetime, json, os, socket, sys, time
    import torch, torch.distributed as dist
    from elastictrain.runtime.inplace import shut_group_sockets, tracked_sockets

    rank, port, shut, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "shut", sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=60))
    with tracked_sockets({port}):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    keep = dist.group.WORLD  # referenced, as FSDP's mesh references it in a paused survivor
    t = torch.ones(4)
    dist.all_reduce(t)
    result = {"rank": rank, "sum": t.tolist()}
    if rank == 2:  # blocked on rank 0, which has "paused"
        started = time.monotonic()
        try:
            dist.recv(t, src=0)
            result["recv"] = "returned"
        except RuntimeError as e:
            result["recv"] = str(e)[:300]
        result["waited_s"] = time.monotonic() - started
    elif rank == 0:
        time.sleep(1.0)
        result["shut"] = shut_group_sockets() if shut else 0
        store.set("after", "1")  # the store's connection (an avoided port) still works
        result["store"] = store.get("after").decode()
        time.sleep(2.5)
    else:
        time.sleep(3.5)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)
''')


def _run(tmp_path: Path, shut: bool) -> dict[int, dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), "shut" if shut else "keep",
                               str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True) for r in range(3)]
    try:
        errs = [p.communicate(timeout=90)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(e[-2000:] for e in errs)
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}


def test_a_paused_rank_shuts_its_group_down_so_a_peer_blocked_on_it_fails_at_once(tmp_path):
    got = _run(tmp_path, shut=True)
    assert got[0]["sum"] == [3.0] * 4
    assert got[0]["shut"] == 2, "one connection to each of the two peers, not the listener nor the store's"
    assert got[0]["store"] == "1"
    assert "closed by peer" in got[2]["recv"].lower() or "reset by peer" in got[2]["recv"].lower(), got[2]
    assert got[2]["waited_s"] < 2.5, f"rank 2 waited {got[2]['waited_s']:.1f} s for the paused rank"


def test_without_it_the_peer_waits_for_as_long_as_the_paused_rank_lives(tmp_path):
    """The flake's mechanism itself: what the shutdown fixes (a referenced gloo group keeps its connections)."""
    got = _run(tmp_path, shut=False)
    assert got[2]["waited_s"] > 2.5, got[2]  # rank 0 lives 3.5 s past the all_reduce
