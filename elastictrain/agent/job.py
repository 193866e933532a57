"""`elastictrain run`: one node of a job — our agent, the etcd v3 rendezvous, status and budget in etcd.

    elastictrain run --config job.yaml [--set f=v ...] [torchrun flags] [--heartbeat-* flags]

Defaults for the torchrun flags come from the config's `elastic` section; flags given on the command line win.
Without an etcd endpoint (flag or `elastic.rdzv_endpoint`) a single-node job starts an embedded etcd on a
free loopback port and stops it at exit. A node re-joins by running the same command again.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from typing import Any, Optional, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elastictrain.agent.agent import ElasticAgent, JsonlEventLog
from elastictrain.agent.budget import FatalWorkerError, RestartBudget, RestartPolicy
from elastictrain.agent.control import ControlRelay
from elastictrain.agent.launch import get_args_parser, launch, parse_args
from elastictrain.agent.spares import RECIPE_MODULE, WarmPool
from elastictrain.agent.status import EtcdStatusPublisher, JobRecord, publish_job, read_events
from elastictrain.config import JobConfig, load_config
from elastictrain.errors import AgentError, ConfigError
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.embedded import EmbeddedEtcd
from elastictrain.rendezvous.settings import EtcdSettings
from elastictrain.runtime.exitcodes import EXIT_FATAL

log = logging.getLogger(__name__)



def _flag_given(argv: Sequence[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _flag_value(argv: Sequence[str], *names: str) -> Optional[str]:
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def torchrun_argv(cfg: JobConfig, config_path: str, overrides: Sequence[str], user_argv: Sequence[str],
                  endpoint: str) -> list[str]:
    """torchrun-style argv: config defaults, then the user's flags (which win), then the recipe."""
    e = cfg.elastic
    argv = [f"--nnodes={e.min_nodes}:{e.max_nodes}", f"--nproc-per-node={e.nproc_per_node}",
            f"--max-restarts={e.max_restarts}", "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={e.run_id}", f"--heartbeat-timeout={e.heartbeat_timeout_s}"]
    if not e.warm_spares:
        argv.append("--no-warm-spares")
    if not _flag_given(user_argv, "--rdzv-conf", "--rdzv_conf"):
        argv.append(f"--rdzv-conf=lease_ttl={e.lease_ttl_s:g},last_call_timeout={e.join_grace_s:g},"
                    f"rejoin_wait={e.rejoin_wait_s:g},join_timeout={e.rdzv_timeout_s:g}")
    argv += list(user_argv)
    argv += ["-m", RECIPE_MODULE, "--config", config_path]
    for o in overrides:
        argv += ["--set", o]
    return argv


def _checkpoint_url(url: Optional[str]) -> Optional[str]:
    """An absolute URL: a relative path means the agent's working directory, which operators' CLIs do not share."""
    if not url or "://" in url:
        return url
    return os.path.abspath(url)


def run_job(config_path: str, overrides: Sequence[str], user_argv: Sequence[str],
            spares: Optional[WarmPool] = None) -> int:
    """Run this node's agent until the job ends; returns the process exit code."""
    cfg = load_config(config_path, list(overrides))  # fail fast, before anything starts
    # A probe script name: any other positional argument (not a flag's value) lands before it.
    probe = get_args_parser().parse_known_args([*user_argv, "__config__"])[0]
    bad = probe.training_script != "__config__" or probe.training_script_args
    if bad or _flag_given(user_argv, "-m", "--module", "--no-python", "--standalone"):
        raise ConfigError(f"elastictrain run takes torchrun flags but no script or --standalone (got "
                          f"{' '.join(user_argv)}); the config names what to train")
    endpoint = _flag_value(user_argv, "--rdzv-endpoint", "--rdzv_endpoint") or cfg.elastic.rdzv_endpoint
    run_id = _flag_value(user_argv, "--rdzv-id", "--rdzv_id") or cfg.elastic.run_id
    with ExitStack() as stack:
        if endpoint is None:
            nnodes = _flag_value(user_argv, "--nnodes") or f"{cfg.elastic.min_nodes}:{cfg.elastic.max_nodes}"
            if nnodes not in ("1", "1:1"):
                raise ConfigError(f"a multi-node job (--nnodes {nnodes}) needs an etcd: pass --rdzv-endpoint "
                                  f"host:2379[,host:2379...] or set elastic.rdzv_endpoint")
            etcd = stack.enter_context(EmbeddedEtcd(die_with_caller=True))  # we run in the main thread
            endpoint = etcd.endpoint
            log.info("no etcd endpoint given: started an embedded etcd at %s (pid %s)", endpoint, etcd.pid)
        request = parse_args(torchrun_argv(cfg, config_path, overrides, user_argv, endpoint))
        settings = EtcdSettings.from_conf(endpoint, run_id, request.config.rdzv_configs)
        client = EtcdClient(settings)
        client.connect()
        stack.callback(client.close)
        e = cfg.elastic
        policy = RestartPolicy(
            max_restarts=request.config.max_restarts, crash_loop_restarts=e.crash_loop_restarts,
            max_no_progress_restarts=e.max_no_progress_restarts, backoff_s=e.restart_backoff_s,
            backoff_max_s=e.restart_backoff_max_s, backoff_jitter=e.restart_backoff_jitter)
        budget = RestartBudget(client, settings.run_prefix, policy=policy)
        ckpt_url = _checkpoint_url(cfg.checkpoint.url)
        publish_job(client, settings.run_prefix, JobRecord(
            run_id=run_id, config=os.path.abspath(config_path), checkpoint_url=ckpt_url, fingerprint=cfg.fingerprint(),
            max_restarts=request.config.max_restarts, min_nodes=request.config.min_nodes,
            max_nodes=request.config.max_nodes, nproc_per_node=request.config.nproc_per_node, steps=cfg.train.steps,
            started=time.time(), restart_policy=asdict(policy)))
        publisher: Optional[EtcdStatusPublisher] = None
        agent_ref: dict[str, Any] = {}
        relay = ControlRelay(client, settings.run_prefix, lambda: publisher.node if publisher else None,
                             lambda kind, fields: publisher.on_event(kind, fields) if publisher else None)
        stack.callback(relay.close)
        os.environ.update(relay.env())  # the workers inherit the agent's environment

        def on_agent(agent: ElasticAgent) -> None:
            nonlocal publisher
            agent_ref["agent"] = agent
            node = getattr(agent.get_worker_group().spec.rdzv_handler, "this_node", None)
            publisher = EtcdStatusPublisher(client, settings.run_prefix, node or f"{os.uname().nodename}_{os.getpid()}",
                                            max_restarts=request.config.max_restarts, budget=budget)
            agent.add_listener(publisher)
            publisher.attach(agent)
            stack.callback(publisher.close)
            relay.attach(agent)
            if request.metrics_port:
                from elastictrain.agent.metrics import AgentCollector, MetricsServer

                metrics = MetricsServer(AgentCollector(publisher.snapshot, ckpt_url), request.metrics_port,
                                        request.metrics_addr)
                stack.callback(metrics.close)

        listeners = [JsonlEventLog(request.event_log)] if request.event_log else []
        try:
            launch(request.config, request.entrypoint, request.args, health=request.health, listeners=listeners,
                   budget=budget, on_agent=on_agent, warm_spares=request.warm_spares, warm_pool=spares)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            log.error("job failed: rank %s exited with %s: %s", rank, failure.exitcode, failure.message)
            return failure.exitcode if failure.exitcode > 0 else 1
        except SignalException as e:
            # A drain: workers finished their step and saved; leave the rendezvous at once so the others
            # re-form without waiting for our lease to expire.
            agent = agent_ref.get("agent")
            liveness = getattr(agent.get_worker_group().spec.rdzv_handler, "liveness", None) if agent else None
            if liveness is not None:
                liveness.stop()
            if publisher is not None:
                publisher.on_event("drain", {"signal": e.sigval.name})
            log.warning("node drained on %s", e.sigval.name)
            return 0 if e.sigval in (signal.SIGTERM, signal.SIGINT) else 128 + int(e.sigval)
        except AgentError as e:
            log.error("%s", e)
            return _exit_code(e)
        except RendezvousClosedError:
            # Another node ended the job (crash loop, spent budget, a fatal worker error) and closed the
            # rendezvous; say why here too.
            why = budget.final_error()
            if why is None and _succeeded(client, settings.run_prefix):
                # A node started (or re-joined) after the others finished: nothing is left to train.
                log.warning("run %s already finished on the other nodes; nothing to do here", run_id)
                return 0
            log.error("rendezvous of run %s was closed by another node: %s", run_id,
                      why or "the job has ended on another node; see `elastictrain events`")
            return _exit_code(why)
    return 0


def _exit_code(error: Optional[AgentError]) -> int:
    """EXIT_FATAL when a worker error ended the job (a scheduler should not resubmit it unchanged), else 1."""
    return EXIT_FATAL if isinstance(error, FatalWorkerError) else 1


def _succeeded(client: EtcdClient, run_prefix: str) -> bool:
    """Whether a node of this run reported its worker group succeeded (the job's events in etcd)."""
    try:
        return any(e.kind == "succeeded" for e in read_events(client, run_prefix))
    except Exception as e:  # status is best effort; without it the closed rendezvous stays an error
        log.warning("could not read the run's events from etcd: %s", e)
        return False


def add_run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run", help="train a job from a YAML config on this node (run the same command on every node)",
        description=__doc__.split("\n\n")[0], epilog="torchrun flags (--nnodes, --nproc-per-node, --rdzv-endpoint, "
        "--rdzv-id, --max-restarts, --rdzv-conf, ...) and --heartbeat-* flags are accepted; see "
        "`python -m elastictrain.agent.launch --help`.")
    p.add_argument("--config", required=True, help="YAML job file, e.g. configs/tiny-cpu.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. --set train.steps=200 (repeatable)")


def main_run(args: Any, extra: list[str], spares: Optional[WarmPool] = None) -> int:
    logging.basicConfig(level=os.environ.get("ELASTICTRAIN_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # torchrun's parser would exit(2) on an unknown flag with usage text; check first for a clear error
    known = {s for a in get_args_parser()._actions for s in a.option_strings}
    unknown = [a.split("=", 1)[0] for a in extra if a.startswith("--") and a.split("=", 1)[0] not in known]
    if unknown:
        raise ConfigError(f"unknown flag(s) {', '.join(unknown)} for elastictrain run; see elastictrain run --help")
    return run_job(args.config, args.overrides, extra, spares)
