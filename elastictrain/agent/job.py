"""`elastictrain run`: one node of a job — our agent, the etcd v3 rendezvous, status and budget in etcd.

    elastictrain run --config job.yaml [--set f=v ...] [torchrun flags] [our flags]         the recipe
    elastictrain run [--config job.yaml] [--set elastic.f=v ...] [flags] script.py [args]   your script
    elastictrain run [--config job.yaml] [--set elastic.f=v ...] [flags] -m module [args]   your module

The agent's settings are the config's `elastic` section (for a script only that section of the file is read; the
script owns its training config), with `--set elastic.*` applied, then the flags given on the command line, which
win. Without an etcd endpoint (flag or `elastic.rdzv_endpoint`) a single-node job starts an embedded etcd on a
free loopback port and stops it at exit. A node re-joins by running the same command again.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elastictrain.agent import snapshots
from elastictrain.agent.agent import ElasticAgent, JsonlEventLog
from elastictrain.agent.budget import FatalWorkerError, RestartBudget, RestartPolicy
from elastictrain.agent.control import ControlRelay
from elastictrain.agent.launch import LaunchRequest, get_args_parser, launch, request_from_args, warm_pool
from elastictrain.agent.replication import Replicator
from elastictrain.agent.scratch import sweep_orphan_scratch
from elastictrain.agent.spares import RECIPE_MODULE, RunArgs, WarmPool
from elastictrain.agent.status import (
    EtcdStatusPublisher,
    JobRecord,
    peer_step_times,
    publish_job,
    read_events,
    read_nodes,
)
from elastictrain.agent.straggler_replace import ReplacePolicy, StragglerReplacer
from elastictrain.checkpoint.replica_tls import ReplicaTLS
from elastictrain.config import ElasticConfig, JobConfig, load_config, load_elastic, replica_rate
from elastictrain.errors import AgentError, ConfigError
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.embedded import EmbeddedEtcd
from elastictrain.rendezvous.liveness import NodeLiveness
from elastictrain.rendezvous.settings import EtcdSettings, conf_flag, conf_seconds
from elastictrain.runtime.allocator import ENV_WORKER_MALLOC, worker_huge_pages_env
from elastictrain.runtime.exitcodes import EXIT_FATAL
from elastictrain.runtime.inplace import ENV_IN_PLACE, InPlaceSettings, generations_store
from elastictrain.runtime.stragglers import ENV_CONFIRM_STEPS, ENV_MARGIN, ENV_STEPS

log = logging.getLogger(__name__)

LEAVE_TOLERANCE_S = 2.0
"""How long each etcd call may retry once the agent leaves on a signal (events, status, lease revoke)."""

_NOT_HERE = ("--standalone", "--no-python", "--no_python", "--run-path", "--run_path")
"""torchrun flags `elastictrain run` refuses: they replace the etcd rendezvous or the Python worker it warms."""


def load_settings(run: RunArgs) -> tuple[Optional[JobConfig], ElasticConfig]:
    """The job config (the recipe's; None for a script) and the agent's `elastic` section, validated."""
    if run.target is None:
        if not run.config:
            raise ConfigError("elastictrain run needs a script (`elastictrain run [flags] train.py [args]`, or "
                              "`-m module`) or a job config for the recipe (`--config job.yaml`)")
        cfg = load_config(run.config, run.overrides)
        return cfg, cfg.elastic
    return None, load_elastic(run.config, run.overrides)


def parse_flags(run: RunArgs, elastic: ElasticConfig) -> argparse.Namespace:
    """The launcher's settings: `elastic`'s values, the flags given over them, and the worker's target."""
    parser = get_args_parser(elastic)
    known = {o for a in parser._actions for o in a.option_strings}
    unknown = [f.split("=", 1)[0] for f in run.flags if f.startswith("-") and f.split("=", 1)[0] not in known]
    if unknown:
        raise ConfigError(f"unknown flag(s) {', '.join(unknown)} for elastictrain run; see elastictrain run --help "
                          f"(the script's own flags go after the script)")
    refused = [f for f in run.flags if f.split("=", 1)[0] in _NOT_HERE]
    if refused:
        raise ConfigError(f"elastictrain run does not take {', '.join(refused)}: it runs Python workers with an etcd "
                          f"rendezvous (leave the flag out, or use torchrun)")
    # The worker's target is set below, not parsed: the flags alone leave the positional empty.
    next(a for a in parser._actions if a.dest == "training_script").nargs = "?"
    args = parser.parse_args(run.flags)
    if args.rdzv_backend != "etcd3":
        raise ConfigError(f"elastictrain run keeps its job state in etcd: --rdzv-backend {args.rdzv_backend} is not "
                          f"supported; leave it out (etcd3), or use torchrun")
    if run.target is None:
        args.module, args.training_script = True, RECIPE_MODULE
        args.training_script_args = ["--config", str(run.config), *[x for o in run.overrides for x in ("--set", o)]]
    else:
        args.module, args.training_script, args.training_script_args = run.module, run.target, run.target_args
    return args


def launch_request(run: RunArgs, elastic: ElasticConfig) -> LaunchRequest:
    """The launch request of a command line whose etcd is given (flag or config)."""
    return request_from_args(parse_flags(run, elastic), elastic)


def _embedded_etcd(nnodes: str, stack: ExitStack) -> str:
    """An etcd of this process's own for a single-node job given none; stopped when `stack` closes."""
    if nnodes not in ("1", "1:1"):
        raise ConfigError(f"a multi-node job (--nnodes {nnodes}) needs an etcd: pass --rdzv-endpoint "
                          f"host:2379[,host:2379...] or set elastic.rdzv_endpoint")
    etcd = stack.enter_context(EmbeddedEtcd(die_with_caller=True))  # we run in the main thread
    log.info("no etcd endpoint given: started an embedded etcd at %s (pid %s)", etcd.endpoint, etcd.pid)
    return etcd.endpoint


def _checkpoint_url(url: Optional[str]) -> Optional[str]:
    """An absolute URL: a relative path means the agent's working directory, which operators' CLIs do not share."""
    if not url or "://" in url:
        return url
    return os.path.abspath(url)


def held_place_s(rdzv_conf: dict[str, Any]) -> float:
    """How long the survivors' agents hold a lost node's place (`--rdzv-conf in_place_rejoin`, which follows
    `elastic.rejoin_wait_s` or a `rejoin_wait` flag): their workers must wait in place exactly as long."""
    return conf_seconds(rdzv_conf, "in_place_rejoin", allow_zero=True)


def run_job(run_argv: Sequence[str], spares: Optional[WarmPool] = None) -> int:
    """Run this node's agent until the job ends; returns the process exit code."""
    run = RunArgs.split(run_argv)
    cfg, elastic = load_settings(run)  # fail fast, before anything starts
    tls = ReplicaTLS.from_config(elastic.replica_tls)
    if tls is not None:
        tls.check()  # a wrong file is a ConfigError now, not a failed replica later
    args = parse_flags(run, elastic)
    for d in sweep_orphan_scratch():
        log.info("removed the scratch folder of a gone agent: %s", d)
    with ExitStack() as stack:
        if not args.rdzv_endpoint:
            args.rdzv_endpoint = _embedded_etcd(args.nnodes, stack)
        request = request_from_args(args, elastic)
        run_id = request.config.run_id
        settings = EtcdSettings.from_conf(request.config.rdzv_endpoint, run_id, request.config.rdzv_configs)
        client = EtcdClient(settings)
        client.connect()
        stack.callback(client.close)
        policy = RestartPolicy(
            max_restarts=request.config.max_restarts, crash_loop_restarts=elastic.crash_loop_restarts,
            max_no_progress_restarts=elastic.max_no_progress_restarts, backoff_s=elastic.restart_backoff_s,
            backoff_max_s=elastic.restart_backoff_max_s, backoff_jitter=elastic.restart_backoff_jitter)
        budget = RestartBudget(client, settings.run_prefix, policy=policy)
        ckpt_url = _checkpoint_url(cfg.checkpoint.url) if cfg is not None else None
        publish_job(client, settings.run_prefix, JobRecord(
            run_id=run_id, config=os.path.abspath(run.config) if run.config else "",
            checkpoint_url=ckpt_url, fingerprint=cfg.fingerprint() if cfg is not None else {},
            max_restarts=request.config.max_restarts, min_nodes=request.config.min_nodes,
            max_nodes=request.config.max_nodes, nproc_per_node=request.config.nproc_per_node,
            steps=cfg.train.steps if cfg is not None else 0, started=time.time(), restart_policy=asdict(policy)))
        publisher: Optional[EtcdStatusPublisher] = None
        agent_ref: dict[str, Any] = {}
        relay = ControlRelay(client, settings.run_prefix, lambda: publisher.node if publisher else None,
                             lambda kind, fields: publisher.on_event(kind, fields) if publisher else None)
        stack.callback(relay.close)
        os.environ.update(relay.env())  # the workers inherit the agent's environment
        os.environ[ENV_WORKER_MALLOC] = elastic.worker_malloc  # applied by each worker as it starts (warmstart)
        os.environ.update(worker_huge_pages_env(elastic.worker_huge_pages, os.environ))  # read as torch loads
        if elastic.in_place:  # the workers reach the run's process-group generations in etcd as the agent does
            os.environ[ENV_IN_PLACE] = InPlaceSettings(request.config.rdzv_endpoint, run_id,
                                                       dict(request.config.rdzv_configs),
                                                       elastic.in_place_timeout_s,
                                                       held_place_s(request.config.rdzv_configs),
                                                       conf_flag(request.config.rdzv_configs,
                                                                 "in_place_shrink")).to_env()
        replacer = _straggler_replacer(elastic, client, settings.run_prefix, request.config.min_nodes, relay,
                                       lambda: publisher.node if publisher else None,
                                       lambda kind, fields: publisher.on_event(kind, fields) if publisher else None)
        snapshot_dir = snapshots.make_snapshot_dir(run_id)
        stack.callback(snapshots.remove, snapshot_dir)  # node RAM: gone with the job

        def on_agent(agent: ElasticAgent) -> None:
            nonlocal publisher
            agent_ref["agent"] = agent
            agent.total_steps = cfg.train.steps if cfg is not None else 0  # no refill spares at the job's end
            if elastic.in_place:
                agent.in_place_store = generations_store(client, settings.run_prefix)
            node = getattr(agent.get_worker_group().spec.rdzv_handler, "this_node", None)
            publisher = EtcdStatusPublisher(client, settings.run_prefix, node or f"{os.uname().nodename}_{os.getpid()}",
                                            max_restarts=request.config.max_restarts, budget=budget)
            agent.add_listener(publisher)
            try:  # the run's calibration, from the nodes that published one (a re-started node's hang prior)
                agent.peer_step_times = peer_step_times(read_nodes(client, settings.run_prefix), publisher.node)
            except Exception as e:  # noqa: BLE001 - etcd down: start uncalibrated, as a first node does
                log.debug("could not read the other nodes' status for a hang prior: %s", e)
            publisher.attach(agent)
            stack.callback(publisher.close)
            relay.attach(agent)
            if replacer is not None:
                replacer.attach(agent)
                agent.add_listener(replacer)
            liveness = getattr(agent.get_worker_group().spec.rdzv_handler, "liveness", None)
            replicator = None
            if liveness is not None:
                replicator = _replicate(stack, snapshot_dir, client, settings.run_prefix, liveness,
                                        request.config.local_addr or socket.getfqdn(),
                                        lambda kind, fields: publisher.on_event(kind, fields) if publisher else None,
                                        replica_rate(elastic), tls, agent.workers_restoring)
            publisher.snapshot_probe = lambda: (snapshots.newest_step(snapshot_dir),
                                                *(replicator.replicated() if replicator else (None, None)))
            if request.metrics_port:
                from elastictrain.agent.metrics import AgentCollector, MetricsServer

                metrics = MetricsServer(AgentCollector(publisher.snapshot, ckpt_url), request.metrics_port,
                                        request.metrics_addr)
                stack.callback(metrics.close)

        listeners = [JsonlEventLog(request.event_log)] if request.event_log else []
        try:
            launch(request.config, request.entrypoint, request.args, health=request.health, listeners=listeners,
                   budget=budget, on_agent=on_agent, warm_spares=request.warm_spares,
                   warm_pool=spares or warm_pool(request))
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            log.error("job failed: rank %s exited with %s: %s", rank, failure.exitcode, failure.message)
            return failure.exitcode if failure.exitcode > 0 else 1
        except SignalException as e:
            # A drain: workers finished their step and saved; leave the rendezvous at once so the others
            # re-form without waiting for our lease to expire. What is left to write to etcd is best effort: with
            # etcd down the agent still leaves within the scheduler's grace period.
            client.limit_tolerance(LEAVE_TOLERANCE_S)
            agent = agent_ref.get("agent")
            liveness = getattr(agent.get_worker_group().spec.rdzv_handler, "liveness", None) if agent else None
            if liveness is not None:
                liveness.stop()
            if publisher is not None:
                publisher.join_s = LEAVE_TOLERANCE_S  # its thread may be retrying a write: flush without it
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


def _straggler_replacer(elastic: ElasticConfig, client: EtcdClient, run_prefix: str, min_nodes: int,
                        relay: ControlRelay, node: Callable[[], Optional[str]],
                        emit: Callable[[str, dict[str, Any]], None]) -> Optional[StragglerReplacer]:
    """With `elastic.replace_stragglers`: the workers confirm stragglers (environment), this agent replaces them.
    The workers' straggler rule (margin, steps) comes from the environment too, replaced or not."""
    os.environ[ENV_MARGIN] = repr(elastic.straggler_margin)
    os.environ[ENV_STEPS] = str(elastic.straggler_steps)
    if not elastic.replace_stragglers:
        return None
    os.environ[ENV_CONFIRM_STEPS] = str(elastic.straggler_replace_after_steps)
    replacer = StragglerReplacer(client, run_prefix, ReplacePolicy(elastic.straggler_drain_window_s, min_nodes),
                                 socket.gethostname(), node, emit, relay.request_reform, relay.drain_self)
    relay.pollers.append(replacer.poll)
    return replacer


def _replicate(stack: ExitStack, folder: Path, client: EtcdClient, run_prefix: str, liveness: NodeLiveness,
               host: str, emit: Callable[[str, dict[str, Any]], None], rate: Optional[int],
               tls: Optional[ReplicaTLS], restoring: Callable[[], bool]) -> Optional[Replicator]:
    """Peer replicas of this node's snapshots, served on `host` (where torch's rendezvous says this node is reached:
    --local-addr, else its host name); a server that cannot start leaves snapshots local-only, never the job down."""
    try:
        replicator = Replicator(folder, client, run_prefix, liveness, host, emit, rate=rate, tls=tls,
                                restoring=restoring)
    except OSError as e:
        log.warning("in-memory snapshots stay local-only: no replica server on %s (%s); set --local-addr to an "
                    "address of this node that the other nodes reach", host, e)
        return None
    stack.callback(replicator.close)
    return replicator


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


def run_help() -> str:
    """`elastictrain run --help`: our config sources, then torchrun's and our flags."""
    parser = get_args_parser(ElasticConfig())
    parser.usage = ("elastictrain run [--config job.yaml] [--set section.field=value ...] [flags] "
                    "[script.py | -m module] [args...]")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("elastictrain config")
    g.add_argument("--config", help="YAML job file: the recipe's whole config, or with a script only its `elastic` "
                   "section (e.g. configs/tiny-cpu.yaml)")
    g.add_argument("--set", metavar="SECTION.FIELD=VALUE", help="override a config field, e.g. --set "
                   "train.steps=200 or --set elastic.nproc_per_node=4 (repeatable; with a script elastic.* only)")
    return parser.format_help()


def main_run(run_argv: Sequence[str], spares: Optional[WarmPool] = None) -> int:
    """`elastictrain run RUN_ARGV`; ``spares``: the pool `start_early` started before torch was imported."""
    if {"-h", "--help"} & set(RunArgs.split(run_argv).flags):
        sys.stdout.write(run_help())
        return 0
    logging.basicConfig(level=os.environ.get("ELASTICTRAIN_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_job(run_argv, spares)
