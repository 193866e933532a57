"""benchmarks/scale.py's results: medians per size, storage, fault and configuration, the snapshot cost, issue #14's
targets, and the PNG (time lost per fault against train-state bytes)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

FAULTS = ("worker_kill", "node_kill", "gone_kill")
"""`gone_kill`: node b lost for good (scale.py --faults ...,gone)."""


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 2) if a is not None and b else None


def summarize(runs: list[dict], sizes: dict[str, dict]) -> dict:
    """Medians per size, storage, fault and configuration; the snapshot cost; the issue's targets."""
    summary: dict = {}
    for r in runs:
        for fault in FAULTS:
            if fault in r:
                cell = summary.setdefault(r["size"], {}).setdefault(r["storage"], {}).setdefault(fault, {})
                cell.setdefault(r["config"], []).append(r[fault])
    for by_storage in summary.values():
        for by_fault in by_storage.values():
            for by_config in by_fault.values():
                for config, rs in by_config.items():
                    ok = [x for x in rs if x["recovered"]]
                    by_config[config] = {
                        "time_lost_s_median": _median([x["time_lost_s"] for x in ok]),
                        "time_lost_s": [x.get("time_lost_s") for x in rs],
                        "recovery_s_median": _median([x["recovery_s"] for x in ok]),
                        "steps_recomputed": [x.get("steps_recomputed") for x in rs],
                        "tier": [x.get("tier") for x in rs], "recovered": f"{len(ok)}/{len(rs)}",
                        "on_two_time_lost_s": [x["on_two"].get("time_lost_s") for x in rs if "on_two" in x],
                        "fault_free_step_s_median": _median([x.get("step_s") for x in rs])}
    return {"summary": summary, "snapshot_cost": snapshot_cost(runs), "targets": targets(summary, runs, sizes)}


def snapshot_cost(runs: list[dict]) -> dict:
    """Fault-free step time with snapshots over without, paired per trial (same size and storage)."""
    out: dict = {}
    step = {(r["size"], r["storage"], r["trial"], r["config"]): r.get("step_s") for r in runs}
    for size, storage in dict.fromkeys((r["size"], r["storage"]) for r in runs):
        trials = sorted({r["trial"] for r in runs if (r["size"], r["storage"]) == (size, storage)})
        pairs = [(step.get((size, storage, t, "ours-snapshot")), step.get((size, storage, t, "ours-durable")))
                 for t in trials]
        ratios = [_ratio(a, b) for a, b in pairs]
        out.setdefault(size, {})[storage] = {
            "ratio_median": _median(ratios), "ratios": ratios,
            "step_s_snapshot": [a for a, _ in pairs], "step_s_durable": [b for _, b in pairs]}
    return out


def targets(summary: dict, runs: list[dict], sizes: dict[str, dict]) -> dict:
    """Issue #14's targets, from the medians: each figure and whether it is met (None: not measured)."""
    ordered = sorted((s for s in sizes if s in summary), key=lambda s: sizes[s]["params"])
    if not ordered:
        return {}
    small, large = ordered[0], ordered[-1]
    lost = {(s, st, f, c): v["time_lost_s_median"] for s, a in summary.items() for st, b in a.items()
            for f, d in b.items() for c, v in d.items()}
    recomputed = [r[f]["steps_recomputed"] for r in runs for f in ("worker_kill", "node_kill")
                  if r["config"] == "ours-snapshot" and r.get(f, {}).get("recovered")]
    out: dict = {"largest_size": large, "smallest_size": small,
                 "ours_snapshot_steps_recomputed_max": max(recomputed, default=None)}
    out["steps_recomputed_le_1"] = None if not recomputed else max(recomputed) <= 1
    for st in {k[1] for k in lost}:
        for f in ("worker_kill", "node_kill"):
            snap = lost.get((large, st, f, "ours-snapshot"))
            vs_stock = _ratio(lost.get((large, st, f, "stock")), snap)
            vs_small = _ratio(snap, lost.get((small, st, f, "ours-snapshot")))
            out[f"{st}:{f}"] = {"stock_over_ours_snapshot_at_largest": vs_stock,
                                "ge_5x": None if vs_stock is None else vs_stock >= 5,
                                "ours_snapshot_largest_over_smallest": vs_small,
                                "le_3x": None if vs_small is None else vs_small <= 3}
    for st in {k[1] for k in lost}:
        # Issue #15: a worker kill costs the in-place path at most one step + 1 s, at every size.
        per_size = {}
        for s in ordered:
            cell = summary.get(s, {}).get(st, {}).get("worker_kill", {}).get("ours-in-place")
            if cell and cell["time_lost_s_median"] is not None and cell["fault_free_step_s_median"] is not None:
                bound = cell["fault_free_step_s_median"] + 1.0
                per_size[s] = {"time_lost_s": cell["time_lost_s_median"], "bound_s": round(bound, 3),
                               "le_1_step_plus_1s": cell["time_lost_s_median"] <= bound,
                               "stock_over_in_place": _ratio(lost.get((s, st, "worker_kill", "stock")),
                                                             cell["time_lost_s_median"])}
        if per_size:
            out[f"{st}:worker_kill:in_place"] = per_size
        # Issue #15: a node lost for good (`gone`): the survivor alone, in place vs restarted; recovery_s runs to
        # the survivor's first completed step (so it includes one step of its own, on 1 rank).
        gone = {}
        for s in ordered:
            cells = summary.get(s, {}).get(st, {}).get("gone_kill", {})
            if "ours-in-place" in cells:
                gone[s] = {c: {"recovery_s": v["recovery_s_median"], "time_lost_s": v["time_lost_s_median"]}
                           for c, v in cells.items()}
                gone[s]["stock_over_in_place"] = _ratio(lost.get((s, st, "gone_kill", "stock")),
                                                        lost.get((s, st, "gone_kill", "ours-in-place")))
        if gone:
            out[f"{st}:gone_kill:in_place"] = gone
    cost = snapshot_cost(runs).get(large, {})
    for st, c in cost.items():
        out[f"{st}:snapshot_cost_at_largest"] = {"ratio": c["ratio_median"],
                                                 "le_5pct": None if c["ratio_median"] is None
                                                 else c["ratio_median"] <= 1.05}
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def plot(result: dict, path: Path) -> None:
    """Time lost per fault against train-state bytes, one line per configuration, a panel per fault and storage."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[bench]'): no {path.name}; rerun with --plot-only",
              flush=True)  # noqa: T201
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    sizes, summary = result["meta"]["sizes"], result["summary"]
    storages = result["meta"]["settings"]["storage"]
    faults = [f for f in FAULTS if any(f in b for a in summary.values() for b in a.values())]
    if not faults:  # every job failed before its first fault: the JSON says why
        print(f"no fault was measured: no {path.name}", flush=True)  # noqa: T201
        return
    fig, axes = plt.subplots(len(faults), len(storages), figsize=(max(6 * len(storages), 9), 4.4 * len(faults)),
                             squeeze=False)
    colors = {"stock": "tab:orange", "ours-durable": "tab:blue", "ours-snapshot": "tab:green",
              "ours-in-place": "tab:purple", "ours-in-place-lease": "tab:pink"}
    for i, f in enumerate(faults):
        for j, st in enumerate(storages):
            ax = axes[i, j]
            for config in result["meta"]["settings"]["configs"]:
                xs, ys = [], []
                for s in sorted(summary, key=lambda s: sizes[s]["params"]):
                    cell = summary[s].get(st, {}).get(f, {}).get(config)
                    if not cell:
                        continue
                    x = sizes[s]["train_state_bytes"]
                    trial = [y for y in cell["time_lost_s"] if y is not None and y > 0]
                    ax.plot([x] * len(trial), trial, ".", color=colors.get(config), alpha=0.35)
                    if cell["time_lost_s_median"] is not None and cell["time_lost_s_median"] > 0:
                        xs.append(x)
                        ys.append(cell["time_lost_s_median"])
                        redo = _median(cell["steps_recomputed"])
                        ax.annotate(f"{redo:g}" if redo is not None else "", (x, ys[-1]), fontsize=7,
                                    xytext=(4, 2), textcoords="offset points", color=colors.get(config))
                ax.plot(xs, ys, "o-", color=colors.get(config), label=config)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
            ax.set_xticks([sizes[s]["train_state_bytes"] for s in summary],
                          [f"{s}\n{_mb(sizes[s]['train_state_bytes'])}" for s in summary], fontsize=8)
            title = "node lost for good (the survivor goes on alone)" if f == "gone_kill" else f.replace("_", " ")
            ax.set_title(f"{title}, durable tier on {st}", fontsize=10)
            ax.set_xlabel("train-state bytes (fp32 params + Adam moments)")
            ax.set_ylabel("time lost per fault (s)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8, title="median; label: steps recomputed", title_fontsize=7)
    m = result["meta"]
    fig.suptitle(f"Time lost per fault (from the fault until one step past, minus a fault-free step)\n"
                 f"{m['date'][:10]}, {m['settings']['trials']} trial(s), load average {m['load_avg_at_start'][0]:.1f} "
                 f"at the start; figures per trial in the JSON", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
