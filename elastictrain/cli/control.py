"""`elastictrain drain NODE | pause | resume | ckpt now`: operator actions through etcd control keys.

Each command writes its control key (see `elastictrain.agent.control`), records an `operator` event, and asks
for confirmation unless `--yes`. The agents act within about a second:

* drain NODE: that node's agent stops as on SIGTERM (workers finish the step and save; the others re-form).
* pause: every rank stops at the same step boundary and waits in place (memory kept, no restart) until resume.
* resume: lifts the pause; the ranks continue together.
* ckpt now: the job saves a checkpoint at its next step boundary (blocking), e.g. before maintenance.
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
import time
from dataclasses import asdict

from elastictrain.agent.control import ControlRequest, ckpt_key, drain_key, pause_key
from elastictrain.agent.status import Event, read_nodes
from elastictrain.cli import target as tgt
from elastictrain.errors import ConfigError


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise ConfigError(f"{question}: no terminal to confirm on; pass --yes")
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


def _record(target: tgt.JobConnection, action: str, **fields: object) -> None:
    ev = Event(time=time.time(), node=f"cli:{_who()}", kind="operator", fields={"action": action, **fields})
    target.client.put(f"{target.prefix}/events/{time.time_ns():020d}-cli",
                      json.dumps(asdict(ev), default=str).encode())


def _request(action: str, reason: str, seq: int = 0) -> bytes:
    return ControlRequest(action=action, by=_who(), time=time.time(), seq=seq, reason=reason).to_json()


def _cmd_drain(args: argparse.Namespace) -> int:
    target = tgt.connect(args)
    try:
        nodes = {n.node: n for n in read_nodes(target.client, target.prefix)}
        matches = [n for n in nodes if n == args.node] or [n for n in nodes if nodes[n].host == args.node]
        if not matches:
            raise ConfigError(f"no node {args.node!r} in run {target.settings.run_id}; nodes: "
                              f"{', '.join(sorted(nodes)) or 'none'} (see elastictrain status)")
        if len(matches) > 1:
            raise ConfigError(f"host {args.node!r} runs several nodes ({', '.join(matches)}): name one")
        node = matches[0]
        if not _confirm(f"drain node {node} ({nodes[node].host}) of run {target.settings.run_id}", args.yes):
            print("cancelled")
            return 1
        target.client.put(drain_key(target.prefix, node), _request("drain", args.reason))
        _record(target, "drain", node=node, reason=args.reason)
        print(f"drain of {node} requested; its agent stops it within a few seconds (elastictrain events -f)")
        return 0
    finally:
        target.close()


def _cmd_pause(args: argparse.Namespace) -> int:
    target = tgt.connect(args)
    try:
        if target.client.get(pause_key(target.prefix)) is not None:
            print(f"run {target.settings.run_id} is already paused (elastictrain resume lifts it)")
            return 0
        if not _confirm(f"pause run {target.settings.run_id} at the next step boundary", args.yes):
            print("cancelled")
            return 1
        target.client.put(pause_key(target.prefix), _request("pause", args.reason))
        _record(target, "pause", reason=args.reason)
        print("pause requested; `elastictrain status` shows PAUSED once every rank waits")
        return 0
    finally:
        target.close()


def _cmd_resume(args: argparse.Namespace) -> int:
    target = tgt.connect(args)
    try:
        if target.client.get(pause_key(target.prefix)) is None:
            print(f"run {target.settings.run_id} is not paused")
            return 0
        if not _confirm(f"resume run {target.settings.run_id}", args.yes):
            print("cancelled")
            return 1
        target.client.delete(pause_key(target.prefix))
        _record(target, "resume", reason=args.reason)
        print("resume requested")
        return 0
    finally:
        target.close()


def _cmd_ckpt_now(args: argparse.Namespace) -> int:
    target = tgt.connect(args)
    try:
        if not _confirm(f"checkpoint run {target.settings.run_id} at the next step boundary", args.yes):
            print("cancelled")
            return 1
        key = ckpt_key(target.prefix)
        while True:  # seq must grow even when two operators ask at once
            current = target.client.get(key)
            seq = (ControlRequest.from_json(current[0]).seq if current else 0) + 1
            written, _, _ = target.client.cas(key, _request("ckpt", args.reason, seq), current[1] if current else None)
            if written:
                break
        _record(target, "ckpt", seq=seq, reason=args.reason)
        print(f"checkpoint requested (request {seq}); `elastictrain status` shows it once committed")
        return 0
    finally:
        target.close()


def _common(p: argparse.ArgumentParser) -> None:
    tgt.add_target_args(p)
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.add_argument("--reason", default="", help="recorded with the event")


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("drain", help="stop one node gracefully (save, leave; the others re-form)",
                       description=__doc__.split("\n\n")[0])
    d.add_argument("node", help="node id (as `elastictrain status` shows it) or its host name")
    _common(d)
    d.set_defaults(func=_cmd_drain)
    p = sub.add_parser("pause", help="pause every rank at the next step boundary (in place) until resume")
    _common(p)
    p.set_defaults(func=_cmd_pause)
    r = sub.add_parser("resume", help="lift a pause")
    _common(r)
    r.set_defaults(func=_cmd_resume)


def register_ckpt_now(ckpt_sub: argparse._SubParsersAction) -> None:
    """`ckpt now`, beside ckpt ls|verify|prune|export."""
    n = ckpt_sub.add_parser("now", help="ask the running job to save a checkpoint at its next step boundary")
    _common(n)
    n.set_defaults(func=_cmd_ckpt_now)
