"""Start our agent on this node: torchrun's flags and launch sequence, our agent and health flags.

``python -m elastictrain.agent.launch [torchrun flags] [--heartbeat-* flags] script.py args...``

Settings have one schema, the config's `elastic` section (`ElasticConfig`): `get_args_parser(elastic)` takes its
values as the flags' defaults, so a flag given on the command line overrides the YAML and nothing is turned into
argv strings to be parsed again.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args
from torch.distributed.run import get_args_parser as torchrun_args_parser

from elastictrain.agent.agent import AgentEventListener, ElasticAgent, JsonlEventLog
from elastictrain.agent.budget import RestartBudget
from elastictrain.agent.health import HealthConfig
from elastictrain.agent.logs_specs import ScratchLogsSpecs
from elastictrain.agent.scratch import sweep_orphan_scratch
from elastictrain.agent.spares import RECIPE_MODULE, SCRIPT_PREWARM, WarmPool
from elastictrain.config import ElasticConfig, HangConfig, Timeouts
from elastictrain.rendezvous.entry_point import ensure_registered
from elastictrain.rendezvous.settings import conf_seconds

log = logging.getLogger(__name__)

DEFAULT_MONITOR_INTERVAL_S = 0.1
"""How often the agent polls its workers (exit detection latency) and drains heartbeats."""


@dataclass
class LaunchRequest:
    """A parsed command line: torch's launch config, the worker command, our health settings."""

    config: LaunchConfig
    entrypoint: Callable[..., Any] | str
    args: list[str]
    health: HealthConfig
    event_log: str | None = None
    metrics_port: int = 0
    metrics_addr: str = "0.0.0.0"
    warm_spares: bool = True
    prewarm: list[str] = field(default_factory=list)
    """Modules the spare workers import before they wait (torch's for a user's script; `--prewarm`)."""


def get_args_parser(elastic: ElasticConfig | None = None) -> argparse.ArgumentParser:
    """torchrun's own parser (every torchrun flag carries over) plus ours, defaulting to ``elastic``'s values.

    Without ``elastic`` torchrun's flags keep torchrun's defaults (`python -m elastictrain.agent.launch`).
    """
    parser = torchrun_args_parser()
    parser.prog = "elastictrain run"
    parser.set_defaults(monitor_interval=DEFAULT_MONITOR_INTERVAL_S)
    hang = (elastic or ElasticConfig()).hang
    g = parser.add_argument_group("elastictrain worker health (config: elastic.hang)")
    g.add_argument("--heartbeat-timeout", type=float, default=hang.floor_s,
                   help="floor (s) of the train-phase hang timeout max(floor, multiplier x p95 step time); "
                        "0 turns hang detection off (elastic.hang.floor_s, default %(default)s)")
    g.add_argument("--heartbeat-step-multiplier", type=float, default=hang.step_time_multiplier,
                   help="train-phase hang timeout in units of the p95 step time (default %(default)s)")
    g.add_argument("--heartbeat-startup-timeout", type=float, default=hang.startup_timeout_s,
                   help="seconds a worker may take to send its first heartbeat (default %(default)s)")
    g.add_argument("--expect-heartbeats", action=argparse.BooleanOptionalAction, default=hang.expect_heartbeats,
                   help="hold workers to the startup timeout from their start; default: yes for the recipe, for a "
                        "script only once one of this node's workers has sent a heartbeat")
    g.add_argument("--heartbeat-warmup-timeout", type=float, default=hang.warmup_timeout_s,
                   help="train-phase timeout before the step time is calibrated (default %(default)s)")
    g.add_argument("--heartbeat-init-timeout", type=float, default=hang.init_timeout_s,
                   help="allowance for the init and paused phases (default %(default)s)")
    g.add_argument("--heartbeat-load-timeout", type=float, default=hang.load_timeout_s,
                   help="allowance for the load phase (default %(default)s)")
    g.add_argument("--heartbeat-save-timeout", type=float, default=hang.save_timeout_s,
                   help="allowance for the save phase (default %(default)s)")
    g.add_argument("--heartbeat-done-timeout", type=float, default=hang.done_timeout_s,
                   help="allowance for the done phase: final save, summary, teardown (default %(default)s)")
    s = parser.add_argument_group("elastictrain spare workers")
    s.add_argument("--no-warm-spares", dest="warm_spares", action="store_false",
                   help="start every worker cold instead of from a pre-warmed spare (saves ~350 MB per local "
                        "rank of idle host memory; restarts then wait for imports)")
    s.add_argument("--prewarm", type=_module_list, default=list(elastic.prewarm) if elastic else [],
                   metavar="MOD[,MOD...]", help="modules the spares import before they wait (a script's spares "
                   "also import torch and torch.distributed)")
    g.add_argument("--event-log", default=None,
                   help="append agent events (join, restart, failure, hang, ...) as JSON lines to this file")
    m = parser.add_argument_group("elastictrain metrics")
    m.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics of this agent on this port (0: off, the default)")
    m.add_argument("--metrics-addr", default="0.0.0.0",
                   help="address the metrics endpoint binds to (default %(default)s)")
    if elastic is not None:
        parser.set_defaults(**_torchrun_defaults(elastic))
    return parser


def _module_list(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def _torchrun_defaults(e: ElasticConfig) -> dict[str, Any]:
    """torchrun's flags' values from the `elastic` section; `--rdzv-conf` keys are merged in `rdzv_configs`."""
    return {"nnodes": f"{e.min_nodes}:{e.max_nodes}", "nproc_per_node": str(e.nproc_per_node),
            "max_restarts": e.max_restarts, "rdzv_backend": "etcd3", "rdzv_endpoint": e.rdzv_endpoint or "",
            "rdzv_id": e.run_id, "warm_spares": e.warm_spares}


def rdzv_configs(e: ElasticConfig) -> dict[str, Any]:
    """The rendezvous settings of the `elastic` section, as `--rdzv-conf` keys (a key given there wins)."""
    return {"lease_ttl": e.lease_ttl_s, "last_call_timeout": e.join_grace_s, "rejoin_wait": e.rejoin_wait_s,
            "join_timeout": e.rdzv_timeout_s, "in_place_rejoin": 0,
            "in_place_shrink": int(e.in_place and e.in_place_shrink), "presence": int(e.presence_link)}


def health_from_args(args: argparse.Namespace) -> HealthConfig:
    """The hang rule's settings: the flags (whose defaults are `elastic.hang`'s)."""
    hang = HangConfig(floor_s=args.heartbeat_timeout, step_time_multiplier=args.heartbeat_step_multiplier,
                      startup_timeout_s=args.heartbeat_startup_timeout, warmup_timeout_s=args.heartbeat_warmup_timeout,
                      init_timeout_s=args.heartbeat_init_timeout, load_timeout_s=args.heartbeat_load_timeout,
                      save_timeout_s=args.heartbeat_save_timeout, done_timeout_s=args.heartbeat_done_timeout)
    runs_recipe = bool(args.module) and args.training_script == RECIPE_MODULE
    expect = args.expect_heartbeats if args.expect_heartbeats is not None else runs_recipe
    return HealthConfig.from_hang(hang, expect_beats=expect)


def effective_timeouts(rdzv_conf: dict[str, Any], health: HealthConfig) -> Timeouts:
    """The timeouts this agent will use, flags and `--rdzv-conf` applied (the config file's were checked with it;
    a flag can still break the order)."""
    def seconds(key: str) -> float:
        return conf_seconds(rdzv_conf, key, allow_zero=True)
    return Timeouts(hang_floor_s=health.hang_floor_s if health.enabled else 0.0, lease_ttl_s=seconds("lease_ttl"),
                    join_grace_s=seconds("last_call_timeout"), rejoin_wait_s=seconds("rejoin_wait"),
                    rdzv_timeout_s=seconds("join_timeout"))


def parse_args(argv: Sequence[str], elastic: ElasticConfig | None = None) -> LaunchRequest:
    """Parse a torchrun-style command line (with our flags) into a launch request; ``elastic`` gives the defaults."""
    return request_from_args(get_args_parser(elastic).parse_args(list(argv)), elastic)


def request_from_args(args: argparse.Namespace, elastic: ElasticConfig | None = None) -> LaunchRequest:
    """A launch request from parsed flags (``elastic``: the config whose values are their defaults)."""
    # torchrun's run() rewrites these before building the config; do the same so the flags mean the same.
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    # Given no log folder, torch's logs specs make a torchelastic_* folder as they are built and never remove it:
    # when nothing of the user's goes there (no redirects, no tee), ours holds the error files in a scratch folder.
    scratch_logs = not args.log_dir and not args.logs_specs and str(args.redirects) == "0" and str(args.tee) == "0"
    if scratch_logs:
        args.log_dir = os.devnull
    try:
        config, entrypoint, cmd_args = config_from_args(args)
    finally:
        if scratch_logs:
            args.log_dir = None
    if scratch_logs:
        config.logs_specs = ScratchLogsSpecs()
    if elastic is not None:
        given = dict(config.rdzv_configs)
        config.rdzv_configs = {**rdzv_configs(elastic), **given}
        if elastic.in_place and "in_place_rejoin" not in given:
            # pause in place holds a lost node's place as long as the rejoin wait (elastic.rejoin_wait_s or a flag)
            config.rdzv_configs["in_place_rejoin"] = config.rdzv_configs["rejoin_wait"]
    health = health_from_args(args)
    effective_timeouts(config.rdzv_configs, health).check()
    user_code = not (args.module and args.training_script == RECIPE_MODULE)
    prewarm = list(dict.fromkeys([*(SCRIPT_PREWARM if user_code else ()), *args.prewarm]))
    return LaunchRequest(config=config, entrypoint=entrypoint, args=list(cmd_args), health=health,
                         event_log=args.event_log, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
                         warm_spares=args.warm_spares, prewarm=prewarm)


def launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any],
    *,
    health: HealthConfig | None = None,
    listeners: Sequence[AgentEventListener] = (),
    budget: RestartBudget | None = None,
    on_agent: Callable[[ElasticAgent], None] | None = None,
    warm_spares: bool = True,
    warm_pool: WarmPool | None = None,
) -> dict[int, Any]:
    """Run our agent until the worker group finishes, like torch's ``launch_agent``.

    Returns the workers' return values by global rank; raises ChildFailedError when the group failed
    with no restarts left, SignalException when the agent was signalled.
    """
    # Workers must not reuse the agent's TCPStore: restarts and scale-up then fail on its stale keys.
    if os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1") != "1":
        log.warning("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=%s is set: restarts may fail on stale store keys",
                    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"])
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        log.warning("no --rdzv-id given; generated run id %s", config.run_id)

    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _static_master(rdzv_parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle

    ensure_registered()
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    shutdown_timeout = getattr(config, "shutdown_timeout", None)  # torch < 2.12's LaunchConfig has no such field
    shutdown_timeout = 30 if shutdown_timeout is None else shutdown_timeout
    agent = ElasticAgent(
        spec,
        config.logs_specs,  # type: ignore[arg-type]  # LaunchConfig fills it in __post_init__
        health=health,
        listeners=listeners,
        budget=budget,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=shutdown_timeout,
        warm_spares=warm_spares,
        warm_pool=warm_pool,
    )
    log.info("starting agent: nodes %d..%d, %d workers per node, rdzv %s at %r (run %s), max restarts %d, "
             "health %s", config.min_nodes, config.max_nodes, config.nproc_per_node, config.rdzv_backend,
             config.rdzv_endpoint, config.run_id, config.max_restarts, health or HealthConfig())

    if on_agent is not None:
        on_agent(agent)
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(name=_entrypoint_name(entrypoint, list(args)), failures=result.failures)
        return result.return_values
    except ChildFailedError:
        raise
    except SignalException:
        # Shutting the rendezvous down would close this run id for good: a signalled node must be able to re-join.
        shutdown_rdzv = False
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        if isinstance(config.logs_specs, ScratchLogsSpecs):
            config.logs_specs.close()


def run(argv: Sequence[str]) -> dict[int, Any]:
    """Parse a torchrun-style command line and launch; see ``launch``."""
    request = parse_args(argv)
    sweep_orphan_scratch()  # the folders of an agent that was SIGKILLed on this node
    listeners = [JsonlEventLog(request.event_log)] if request.event_log else []
    return launch(request.config, request.entrypoint, request.args, health=request.health, listeners=listeners,
                  warm_spares=request.warm_spares, warm_pool=warm_pool(request))


def warm_pool(request: LaunchRequest) -> WarmPool | None:
    """An empty pool for the request's worker command with its pre-imports (the agent sizes and fills it)."""
    if not isinstance(request.entrypoint, str):
        return None
    return WarmPool(request.entrypoint, request.args, 0, request.prewarm)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: 0 when the worker group succeeded, 1 otherwise."""
    logging.basicConfig(level=os.environ.get("ELASTICTRAIN_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        log.error("worker group failed; first failure rank %s: %s", rank, failure.message)
        return 1
    return 0


def _static_master(params: RendezvousParameters) -> tuple[str | None, int | None]:
    """MASTER_ADDR/PORT come from the endpoint only for the static backend (as in torch's launcher)."""
    if params.backend != "static":
        return None, None
    endpoint = params.endpoint.strip()
    if not endpoint:
        raise ValueError("the static rendezvous needs an endpoint: pass --master-addr and --master-port")
    addr, port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    if port == -1:
        raise ValueError(f"port is missing in rendezvous endpoint {endpoint!r}: pass --master-port")
    return addr, port


def _entrypoint_name(entrypoint: Callable[..., Any] | str, args: list[Any]) -> str:
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", repr(entrypoint))
    if entrypoint == sys.executable:
        return next((str(a) for a in args if not str(a).startswith("-")), "")
    return entrypoint


if __name__ == "__main__":
    sys.exit(main())
