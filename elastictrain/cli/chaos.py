"""`elastictrain chaos`: run a fault schedule against a live job on this machine.

The schedule is text (`--schedule "kill-worker@step=50, kill-node@t=120s/10s"`, grammar in docs/chaos.md) or
seeded random (`--random N --every S --seed K`). One line per fault fired, healed or skipped; with --event-log, one
JSON record per fault. Exit 0 when the schedule ran (skipped faults included), 2 on an error (bad schedule, no
such job), 130 when interrupted (faults in place are healed first).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any

from elastictrain.chaos.schedule import DEFAULT_DURATIONS, KINDS, NODE_KINDS, Schedule
from elastictrain.cli import target as tgt
from elastictrain.cli.ckpt import parse_storage_options
from elastictrain.errors import ConfigError


def build_schedule(args: argparse.Namespace) -> Schedule:
    """The schedule from --schedule (text or @file) or --random; ConfigError says which flag to fix."""
    if (args.schedule is None) == (args.random is None):
        raise ConfigError("give exactly one of --schedule 'KIND[:NODE][@step=N|@t=S][/DURATION], ...' or "
                          "--random N --every S")
    if args.schedule is not None:
        text = args.schedule
        if text.startswith("@"):
            try:
                with open(text[1:], encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ConfigError(f"--schedule {args.schedule}: cannot read the file ({e.strerror})") from None
        return Schedule.parse(text, seed=args.seed)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip()) if args.kinds else KINDS
    return Schedule.random(args.seed, args.random, kinds=kinds, start_s=args.start, every_s=args.every)


def plan_lines(schedule: Schedule) -> list[str]:
    """The schedule as a human reads it: one line per fault with its trigger, target and heal time."""
    out = [f"chaos schedule, seed {schedule.seed}, {len(schedule.faults)} fault(s):"]
    for i, f in enumerate(schedule.faults, 1):
        when = (f"at step {f.at_step}" if f.at_step is not None else
                f"at t={f.at_time:g}s" if f.at_time is not None else "right after the previous one")
        where = ""
        if f.kind in NODE_KINDS:
            where = f" on {f.target}" if f.target else " on a seeded choice of live node"
            if f.rank is not None:
                where += f", rank {f.rank}"
        heal = f.heal_after
        if heal is None:
            healed = ", nothing to heal"
        else:
            healed = f", healed after {heal:g}s" + ("" if f.duration is not None else " (default)")
        out.append(f"  {i:2d}. {f.describe():40s} {when}{where}{healed}")
    return out


def _line(what: str, r: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    if what == "skipped":
        return f"{stamp} skipped {r['fault']}: {r['skipped']}"
    node = f" on {r['node']}" if r["node"] else ""
    if what == "fired":
        return f"{stamp} +{r['fired_at_s']:.1f}s fired {r['fault']}{node} (step {r['fired_step']}): {r['detail']}"
    said = r.get("heal_error") and f"heal FAILED: {r['heal_error']}" or r.get("heal_detail") or "done"
    return f"{stamp} +{r['healed_at_s']:.1f}s healed {r['fault']}{node}: {said}"


def _cmd_chaos(args: argparse.Namespace) -> int:
    from elastictrain.chaos.local import LocalOptions, LocalTarget
    from elastictrain.chaos.runner import ChaosRunner

    schedule = build_schedule(args)
    if args.dry_run:
        print("\n".join(plan_lines(schedule)))
        return 0
    options = LocalOptions(checkpoint_url=args.checkpoint_url,
                           storage_options=parse_storage_options(args.storage_option) or None,
                           etcd_pid=args.etcd_pid, etcd_restart_cmd=args.etcd_restart_cmd,
                           s3_server_pid=args.s3_server_pid, relaunch_log=args.relaunch_log)
    job = tgt.connect(args)
    stop = threading.Event()
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signum)
        stop.set()  # the runner heals every fault in place before it returns

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print("\n".join(plan_lines(schedule)), flush=True)
        target = LocalTarget(job.client, job.settings, options)
        runner = ChaosRunner(schedule, target, event_log=args.event_log, min_gap_s=args.min_gap,
                             on_event=lambda what, r: print(_line(what, r), flush=True))
        records = runner.run(stop=stop, timeout=args.timeout)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        job.close()
    fired = sum(r["fired_at_s"] is not None for r in records)
    print(f"chaos: {fired} of {len(records)} fault(s) fired, {len(records) - fired} skipped"
          + (f"; event log {args.event_log}" if args.event_log else ""), flush=True)
    return 130 if interrupted else 0


def register(sub: argparse._SubParsersAction) -> None:
    kinds = ", ".join(f"{k} (heal {DEFAULT_DURATIONS[k]:g}s)" if DEFAULT_DURATIONS[k] else k for k in KINDS)
    p = sub.add_parser("chaos", help="inject a schedule of faults into a live job on this machine",
                       description=__doc__.split("\n\n")[0] + " Fault kinds: " + kinds + ".")
    tgt.add_target_args(p)
    p.add_argument("--rdzv-endpoint", dest="endpoint", default=None, metavar="HOST:PORT",
                   help="the job's --rdzv-endpoint (same as --endpoint)")
    p.add_argument("--rdzv-id", dest="run_id", default=None, help="the job's --rdzv-id (same as --run-id)")
    s = p.add_argument_group("schedule")
    s.add_argument("--schedule", default=None, metavar="TEXT|@FILE",
                   help="faults, e.g. 'kill-worker@step=50, kill-node:NODE@t=120s/10s' (see docs/chaos.md)")
    s.add_argument("--random", type=int, default=None, metavar="N", help="N seeded-random faults instead")
    s.add_argument("--every", type=float, default=15.0, metavar="S",
                   help="seconds between random faults (default %(default)s)")
    s.add_argument("--start", type=float, default=10.0, metavar="S",
                   help="seconds before the first random fault (default %(default)s)")
    s.add_argument("--kinds", default=None, metavar="K,K", help="kinds random faults are drawn from (default: all)")
    s.add_argument("--seed", type=int, default=0, help="seed of random schedules and of node/rank choices")
    s.add_argument("--min-gap", type=float, default=0.0, metavar="S", help="least seconds between two faults")
    s.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop after S seconds (unfired faults are skipped, fired ones healed)")
    s.add_argument("--dry-run", action="store_true", help="print the planned schedule and exit")
    s.add_argument("--event-log", default=None, metavar="FILE", help="append one JSON record per fault")
    f = p.add_argument_group("what some faults need")
    f.add_argument("--checkpoint-url", default=None,
                   help="checkpoint storage for storage-*/corrupt-checkpoint (default: the job's published URL)")
    f.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec/s3fs option of an s3:// checkpoint URL, as for `elastictrain ckpt` (repeatable; "
                        "default: the job config's checkpoint.storage_options)")
    f.add_argument("--etcd-restart-cmd", default=None, metavar="CMD",
                   help="shell command that starts the job's etcd again with its data (needed by restart-etcd)")
    f.add_argument("--etcd-pid", type=int, default=None,
                   help="etcd's pid (default: the process listening on the endpoint's port here)")
    f.add_argument("--s3-server-pid", type=int, default=None,
                   help="the S3 server's pid for storage-down/-stall (default: the process listening on the "
                        "checkpoint URL's endpoint here)")
    f.add_argument("--relaunch-log", default=None, metavar="FILE",
                   help="where re-launched agents write (default: the file the killed agent's output went to)")
    p.set_defaults(func=_cmd_chaos)
