"""Which job an operator command talks to: etcd endpoint, run id and credentials, with clear errors.

Defaults come from `--config job.yaml` (its `elastic.rdzv_endpoint` and `elastic.run_id`), then from the
environment (ELASTICTRAIN_ENDPOINT, ELASTICTRAIN_RUN_ID); flags win. TLS and authentication take the same
`--rdzv-conf` keys as `elastictrain run` (cacert, cert, key, user, password).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from elastictrain.errors import ConfigError, RendezvousError
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings

# An operator command should answer within seconds, not ride out a minute-long outage like a running job.
_CLI_CONF = {"connect_timeout": 3.0, "request_timeout": 3.0, "outage_tolerance": 3.0}


def add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job")
    g.add_argument("--endpoint", default=None, metavar="HOST:PORT[,...]",
                   help="etcd endpoint(s) of the job (default: --config's elastic.rdzv_endpoint, "
                        "else $ELASTICTRAIN_ENDPOINT)")
    g.add_argument("--run-id", default=None, help="the job's --rdzv-id (default: --config's elastic.run_id, "
                                                  "else $ELASTICTRAIN_RUN_ID)")
    g.add_argument("--config", default=None, help="the job's YAML file, for the defaults above")
    g.add_argument("--rdzv-conf", default="", metavar="K=V,...",
                   help="etcd TLS/auth as for `elastictrain run`: cacert=,cert=,key=,user=,password=")


@dataclass
class JobConnection:
    """An open etcd client for one job's keys (an operator command's connection, not a chaos target)."""

    client: EtcdClient
    settings: EtcdSettings

    @property
    def prefix(self) -> str:
        return self.settings.run_prefix

    def close(self) -> None:
        self.client.close()


def parse_conf(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep or not k:
            raise ConfigError(f"--rdzv-conf {part!r}: expected KEY=VALUE, e.g. cacert=/etc/etcd/ca.pem")
        out[k.strip()] = v.strip()
    return out


def resolve(args: argparse.Namespace) -> tuple[str, str]:
    """(endpoint, run_id) from the flags, the config, then the environment."""
    endpoint, run_id = args.endpoint, args.run_id
    if args.config and (endpoint is None or run_id is None):
        from elastictrain.config import load_config

        cfg = load_config(args.config, [])
        endpoint = endpoint or cfg.elastic.rdzv_endpoint
        run_id = run_id or cfg.elastic.run_id
    endpoint = endpoint or os.environ.get("ELASTICTRAIN_ENDPOINT")
    run_id = run_id or os.environ.get("ELASTICTRAIN_RUN_ID")
    if not endpoint:
        raise ConfigError("no etcd endpoint: pass --endpoint HOST:2379, --config job.yaml with "
                          "elastic.rdzv_endpoint, or set ELASTICTRAIN_ENDPOINT")
    if not run_id:
        raise ConfigError("no run id: pass --run-id (the job's --rdzv-id), --config job.yaml, or set "
                          "ELASTICTRAIN_RUN_ID")
    return endpoint, run_id


def connect(args: argparse.Namespace, *, must_exist: bool = True) -> JobConnection:
    """Connect to the job's etcd; RendezvousError when unreachable or refused, or (must_exist) no such run."""
    endpoint, run_id = resolve(args)
    conf = {**_CLI_CONF, **parse_conf(args.rdzv_conf)}
    settings = EtcdSettings.from_conf(endpoint, run_id, conf)
    client = EtcdClient(settings)
    client.connect()
    target = JobConnection(client, settings)
    if must_exist and not run_exists(target):
        others = list_runs(target)
        target.close()
        hint = f"runs there: {', '.join(others[:10])}" if others else "no runs there at all"
        raise RendezvousError(f"no run {run_id!r} at etcd {settings.endpoints_str()} (nothing under "
                              f"{settings.run_prefix}/); check --run-id ({hint})")
    return target


def run_exists(target: JobConnection) -> bool:
    p = target.prefix
    return any(target.client.get(k) is not None for k in (f"{p}/rdzv", f"{p}/status/job")) or bool(
        target.client.get_prefix(f"{p}/status/nodes/"))


def list_runs(target: JobConnection) -> list[str]:
    """Run ids with any key under the key prefix (keys only; for the error message)."""
    base = target.settings.key_prefix.rstrip("/") + "/"
    try:
        items = target.client.call("list runs", lambda c: list(c.get_prefix(base, keys_only=True)))
    except RendezvousError:
        return []
    return sorted({meta.key.decode()[len(base):].split("/", 1)[0] for _, meta in items})
