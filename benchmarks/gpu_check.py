"""One short check of the CUDA path, for a session that is lent a GPU machine (not part of the test suite).

Three runs of the recipe under our agent on one node, each a subprocess, from `--config` cut to a few steps:

  A  uninterrupted, `--steps` steps (durable checkpoints every `--every` steps, in-memory snapshots);
  B  the same, with its worker SIGKILLed once the first durable checkpoint is committed: the agent must restart
     it and the run must finish; its final digest is compared with A's (bitwise is reported, not required; the
     first H200 run, with train.deterministic true, was not bitwise: hence `--deterministic strict` by default);
  C  B's command again with more steps: it must resume from B's last checkpoint (start_step == B's final step);
  D  (--in-place) B with `elastic.in_place: true`: the worker is replaced in place from its snapshot.

Then `ckpt verify` on B's checkpoints. Writes `<out>/gpu_check.json` and each run's log; exits 1 when a run
fails. On a CPU machine `--config configs/tiny-cpu.yaml --device cpu` exercises the same driver.

    python3 benchmarks/gpu_check.py --config configs/gpu.yaml --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastictrain.chaos.process_signals import worker_pids  # noqa: E402

CLI = [sys.executable, "-m", "elastictrain.cli.main"]


def _overrides(args: argparse.Namespace, work: Path, name: str, steps: int, extra: dict) -> list[str]:
    sets = {
        "train.steps": steps, "train.output_dir": work / name / "out", "train.log_every": 1,
        "train.param_digest": "true", "train.device": args.device, "train.deterministic": args.deterministic,
        "checkpoint.url": work / name / "ckpt", "checkpoint.every_steps": args.every,
        "checkpoint.every_seconds": 0, "checkpoint.keep_last": 3, "checkpoint.snapshot_every_steps": "auto",
        "data.global_batch_size": args.global_batch, "data.micro_batch_size": args.micro_batch,
        "elastic.nproc_per_node": args.nproc, **extra,
    }
    if args.seq_len:
        sets["data.seq_len"] = args.seq_len
    out: list[str] = []
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    return out


def _run(args, work: Path, name: str, steps: int, kill: bool, log_dir: Path, dirname: str = "",
         extra: dict | None = None) -> dict:
    dirname = dirname or name
    cmd = [*CLI, "run", "--config", args.config, *_overrides(args, work, dirname, steps, extra or {})]
    log_path = log_dir / f"run_{name}.log"
    t0 = time.monotonic()
    res: dict = {"name": name, "steps": steps, "cmd": " ".join(map(str, cmd))}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        try:
            if kill:
                marker_dir = work / dirname / "ckpt"
                deadline = time.monotonic() + args.timeout
                while time.monotonic() < deadline and proc.poll() is None:
                    if any(marker_dir.glob("step-*/COMMITTED")):
                        break
                    time.sleep(0.2)
                pids = worker_pids(proc.pid)
                res["workers"] = pids
                res["kill_at_s"] = round(time.monotonic() - t0, 2)
                if pids:
                    res["killed"] = min(pids.items())
                    os.kill(res["killed"][1], signal.SIGKILL)
            proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            res["timed_out"] = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    res["rc"] = proc.returncode
    res["log_tail"] = log_path.read_text()[-1500:]
    res["wall_s"] = round(time.monotonic() - t0, 2)
    summary = work / dirname / "out" / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        res.update({k: s.get(k) for k in ("start_step", "final_step", "final_loss", "param_digest", "world_size",
                                           "tokens_per_s", "step_time_s_median")})
        res["job_wall_s"] = s.get("wall_s")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/gpu.yaml")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check"))
    p.add_argument("--work", default="/tmp/gpu_check_work")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=0)
    p.add_argument("--deterministic", default="strict", help="train.deterministic (strict: bitwise on CUDA)")
    p.add_argument("--in-place", action="store_true", help="a fourth run D: B with elastic.in_place")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"argv": sys.argv[1:]}
    try:
        import torch
        report["torch"] = torch.__version__
        report["cuda"] = torch.version.cuda
        report["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            report["gpu"] = torch.cuda.get_device_name(0)
            report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        report["torch_error"] = repr(e)
    runs = report["runs"] = []

    def save() -> None:
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))

    runs.append(_run(args, work, "a", args.steps, False, out))
    save()
    runs.append(_run(args, work, "b", args.steps, True, out))
    save()
    runs.append(_run(args, work, "c", args.steps + args.every, False, out, dirname="b"))
    save()
    if args.in_place:
        runs.append(_run(args, work, "d", args.steps, True, out, extra={"elastic.in_place": "true"}))
        save()
    v = subprocess.run([*CLI, "ckpt", "verify", str(work / "b" / "ckpt")], capture_output=True, text=True, cwd=ROOT)
    report["verify"] = {"rc": v.returncode, "out": (v.stdout + v.stderr)[-3000:]}
    a, b, c = runs[:3]
    report["checks"] = {
        "a_ok": a["rc"] == 0 and a.get("final_step") == args.steps,
        "b_ok": b["rc"] == 0 and b.get("final_step") == args.steps and bool(b.get("killed")),
        "b_bitwise_as_a": bool(a.get("param_digest")) and a.get("param_digest") == b.get("param_digest"),
        "c_resumed_from_b": c["rc"] == 0 and c.get("start_step") == args.steps,
        "verify_ok": v.returncode == 0,
    }
    if args.in_place:
        d = runs[3]
        report["checks"]["d_in_place_ok"] = d["rc"] == 0 and d.get("final_step") == args.steps
        report["checks"]["d_bitwise_as_a"] = a.get("param_digest") == d.get("param_digest")
    save()
    ok = all(v for k, v in report["checks"].items() if not k.endswith("bitwise_as_a"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
