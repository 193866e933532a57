"""What `checkpoint.snapshot_every_steps: auto` costs a 2-node job: the interval it picks and the step time it gives,
against the same job with durable checkpoints only, side by side in one run.

    python benchmarks/snapshot_pace.py [--sizes 50m,150m] [--rounds 1] [--configs ours-durable,ours-auto]
                                       [--measure 10] [--out PATH]

Each job is scale.py's (`ScaleJob`: the recipe at the size's shape, 2 nodes x 1 worker on this host, our agent
with its tuned settings, durable checkpoints every 5 steps to a local folder, peer replicas on), without faults.
`auto` probes for its first steps (`PROBE_STEPS`), then snapshots at the interval it chose. Measured: the mean step
time over `--measure` steps after the probe and `SETTLE` more (the same steps, so the same durable saves, in each
job; the median is kept beside it, see `steady_step_s`); its ratio to the durable-only job's is the snapshot cost
at the chosen interval, the replication to the peer included (issue #14's target: <= 1.05). The interval and the
probe's own figures (`cost_s`, `step_s`) come from the workers' `checkpoint_snapshot_interval` event.
Configurations alternate within a round.

Writes benchmarks/results/snapshot_pace.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.recovery import Completed, unwind_on_sigterm  # noqa: E402
from benchmarks.scale import CONFIGS, SIZES, ScaleJob, wait_steps  # noqa: E402
from elastictrain.agent.status import read_events  # noqa: E402
from elastictrain.rendezvous.client import EtcdClient  # noqa: E402
from elastictrain.rendezvous.embedded import EmbeddedEtcd  # noqa: E402
from elastictrain.rendezvous.settings import EtcdSettings  # noqa: E402
from elastictrain.runtime.snapshot_pacing import PROBE_STEPS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "snapshot_pace.json"
SETTLE = 4
"""Steps after the probe left out: the first snapshots at the new interval map their slots."""
TARGET = 1.05


def steady_step_s(done: list[Completed], first: int, last: int) -> tuple[Optional[float], Optional[float]]:
    """Steps first..last of the one 2-node group: the mean step time ((t_last - t_first) / steps: what throughput
    sees, the durable saves' steps included) and the median step-to-step time (which leaves the saves' slow steps
    out: in the durable-only job a save at 150M makes its step ~4 s longer, with snapshots the save is written from
    the slot and its cost spreads over the steps after it, which a median then counts)."""
    steps = {c.step: c for c in done if c.world == 2 and first <= c.step <= last}
    if first not in steps or last not in steps or len({c.seq for c in steps.values()}) != 1:
        return None, None
    ordered = [steps[k] for k in sorted(steps)]
    gaps = [b.time - a.time for a, b in zip(ordered, ordered[1:]) if b.step == a.step + 1]
    return (steps[last].time - steps[first].time) / (last - first), statistics.median(gaps) if gaps else None


def chosen_interval(job: ScaleJob) -> Optional[dict]:
    """The `checkpoint_snapshot_interval` event's fields (interval, the probe's cost_s and step_s), from etcd."""
    settings = EtcdSettings.from_conf(str(job.endpoint), job.run_id, {})
    client = EtcdClient(settings)
    client.connect()
    try:
        found = [e.fields for e in read_events(client, settings.run_prefix) if e.kind == "checkpoint_snapshot_interval"]
    finally:
        client.close()
    return {k: found[0].get(k) for k in ("interval", "cost_s", "step_s", "overhead")} if found else None


def run_one(config: str, size: str, work: Path, endpoint: str, measure: int, timeout: float) -> dict:
    job = ScaleJob(config, size, work, endpoint, None, {"ours": "tuned", "stock": "defaults"}, rejoin_wait=60.0)
    first, last = PROBE_STEPS + SETTLE, PROBE_STEPS + SETTLE + measure
    try:
        job.start_both()
        if not wait_steps(job, -1, last + 2, 2, timeout):
            return {"error": f"not {last + 2} steps on 2 nodes within {timeout:.0f} s"}
        done = job.watch.snapshot()
        two = sorted((c for c in done if c.world == 2), key=lambda c: c.step)
        mean, median = steady_step_s(done, first, last)
        return {"step_s": mean, "median_step_s": median, "steps": [first, last],
                "interval": chosen_interval(job) if CONFIGS[config][1] == "auto" else None,
                "step_times": {c.step: round(c.time - two[0].time, 3) for c in two}}
    finally:
        job.clean()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="50m,150m")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--configs", default="ours-durable,ours-auto",
                   help="of scale.py's ours-* configurations, or ours-every-N (a fixed interval of N steps)")
    p.add_argument("--measure", type=int, default=10, help="steps measured (a multiple of the save interval, 5)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--note", default="")
    args = p.parse_args()
    unwind_on_sigterm()
    sizes, configs = args.sizes.split(","), args.configs.split(",")
    for s in sizes:
        if s not in SIZES:
            p.error(f"--sizes: {s!r} is not one of {', '.join(SIZES)}")
    for c in configs:
        if c.startswith("ours-every-") and c.removeprefix("ours-every-").isdigit():
            CONFIGS[c] = ("ours", int(c.removeprefix("ours-every-")))  # a fixed interval
        if c not in CONFIGS or CONFIGS[c][0] != "ours":
            p.error(f"--configs: {c!r} is not one of ours' configurations in scale.py ({', '.join(CONFIGS)})")
    runs = []
    started = time.monotonic()
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="snapshot-pace-") as tmp:
        for size in sizes:
            for rnd in range(args.rounds):
                order = configs if rnd % 2 == 0 else configs[::-1]
                for config in order:
                    res = run_one(config, size, Path(tmp) / f"{size}-{rnd}-{config}", etcd.endpoint, args.measure,
                                  args.timeout)
                    runs.append({"size": size, "round": rnd, "config": config, **res})
                    print(json.dumps(runs[-1]), flush=True)  # noqa: T201
    summary: dict = {}
    for size in sizes:
        med = {c: statistics.median(x) if (x := [r["step_s"] for r in runs if r["size"] == size
                                                  and r["config"] == c and r.get("step_s")]) else None
               for c in configs}
        base = med.get("ours-durable")
        summary[size] = {c: {"mean_step_s": round(v, 4) if v else None,
                             "ratio_to_durable": round(v / base, 3) if v and base else None,
                             "interval": [r["interval"] for r in runs if r["size"] == size and r["config"] == c
                                          and r.get("interval")] or None}
                         for c, v in med.items()}
    out = {"meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(["python", "benchmarks/snapshot_pace.py", *sys.argv[1:]]),
                    "torch": torch.__version__, "python": platform.python_version(), "note": args.note,
                    "target_ratio": TARGET, "probe_steps": PROBE_STEPS, "settle_steps": SETTLE,
                    "wall_s": round(time.monotonic() - started, 1)},
           "summary": summary, "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))  # noqa: T201


if __name__ == "__main__":
    main()
