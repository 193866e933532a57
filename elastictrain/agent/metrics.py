"""Prometheus metrics endpoint of one agent (`elastictrain run --metrics-port PORT`; 0, the default, is off).

Values are read at scrape time from the status the agent already publishes to etcd, so a scrape costs no
training time. The checkpoint age needs a listing of the checkpoint root: it is cached for `ckpt_cache_s`.

    elastictrain_step                          newest global step reported by this node's workers
    elastictrain_step_time_seconds             calibrated (p95) step time
    elastictrain_restarts_used / _max          the job-wide restart budget
    elastictrain_worker_heartbeat_age_seconds  per local rank, seconds since its last heartbeat
    elastictrain_checkpoint_step / _age_seconds the newest valid checkpoint
    elastictrain_node_up{state}                1 for this node's current state

The job's time ledger (`ledger.py`; job-wide, the same on every node: aggregate with max, not sum), read from etcd
at most every `ledger_cache_s`:

    elastictrain_time_seconds{bucket}          wall time per bucket: training, checkpoint, paused, detecting,
                                               restarting, loading, recomputing, starting (they add up to the next)
    elastictrain_wall_seconds                  wall time since the job began
    elastictrain_ettr                          effective training time ratio: training / wall
    elastictrain_faults_total{kind}            faults so far, by kind (worker failure, hang, node lost, ...)
    elastictrain_fault_lost_seconds_total{kind} seconds they cost (detect + restart + load + recompute)
    elastictrain_recomputed_steps_total        steps run again after faults
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from elastictrain.agent.ledger import Ledger
from elastictrain.agent.status import NodeStatus

log = logging.getLogger(__name__)

DEFAULT_CKPT_CACHE_S = 15.0


def latest_checkpoint(url: Optional[str]) -> Optional[tuple[int, float, str]]:
    """(step, created_at, its URL) of the newest valid checkpoint under `url`, or None (none, or unreadable)."""
    if not url:
        return None
    from elastictrain.checkpoint.discovery import find_latest_valid
    from elastictrain.checkpoint.storage import open_storage

    try:
        storage = open_storage(url)
        info = find_latest_valid(storage)
        if info is None and storage.list_files():
            info = find_latest_valid(storage)  # retention deleted one while we looked: once more
        if info is None:
            return None
        created = info.manifest.metadata.created_at if info.manifest is not None else time.time()
        return info.step, created, info.url
    except Exception as e:  # storage down: the metric is absent, the scrape still answers
        log.debug("checkpoint listing of %s failed: %s", url, e)
        return None


class AgentCollector(Collector):
    def __init__(self, snapshot: Callable[[], NodeStatus], ckpt_url: Optional[str],
                 ckpt_cache_s: float = DEFAULT_CKPT_CACHE_S, ledger: Optional[Callable[[], Optional[Ledger]]] = None):
        """`ledger`: the job's time ledger (default: the `ledger` method of `snapshot`'s publisher, if any)."""
        self._snapshot, self._url, self._cache_s = snapshot, ckpt_url, ckpt_cache_s
        self._ledger = ledger if ledger is not None else getattr(getattr(snapshot, "__self__", None), "ledger", None)
        self._ckpt: Optional[tuple[int, float, str]] = None
        self._ckpt_at = -1e18
        self._lock = threading.Lock()

    def _checkpoint(self) -> Optional[tuple[int, float, str]]:
        with self._lock:
            if time.monotonic() - self._ckpt_at > self._cache_s:
                self._ckpt, self._ckpt_at = latest_checkpoint(self._url), time.monotonic()
            return self._ckpt

    def collect(self) -> Iterator[Any]:
        st = self._snapshot()
        labels = ["node"]

        def gauge(name: str, doc: str, value: Optional[float]) -> Iterator[Any]:
            if value is None:
                return
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([st.node], float(value))
            yield g

        yield from gauge("elastictrain_step", "Newest global step reported by this node's workers", st.step)
        yield from gauge("elastictrain_step_time_seconds", "Calibrated (p99) step time", st.step_time_s)
        yield from gauge("elastictrain_restarts_used", "Restarts charged to the job-wide budget", st.restarts_used)
        yield from gauge("elastictrain_restarts_max", "The job-wide restart budget", st.max_restarts)
        hb = GaugeMetricFamily("elastictrain_worker_heartbeat_age_seconds", "Seconds since the worker's last "
                               "heartbeat", labels=["node", "local_rank"])
        for w in st.workers:
            if w.heartbeat_age_s is not None:
                hb.add_metric([st.node, str(w.local_rank)], w.heartbeat_age_s)
        yield hb
        slow = GaugeMetricFamily("elastictrain_straggler_lateness_seconds", "Seconds per step a rank named a "
                                 "straggler is late (only ranks named now; reported on rank 0's node)",
                                 labels=["node", "rank"])
        for rank, info in sorted(st.stragglers.items()):
            if isinstance(info.get("lateness_s"), (int, float)):
                slow.add_metric([st.node, rank], float(info["lateness_s"]))
        yield slow
        replaced = CounterMetricFamily("elastictrain_stragglers_replaced", "Stragglers of this node its agent "
                                       "replaced (elastic.replace_stragglers), by action", labels=["node", "action"])
        for action, count in sorted(st.stragglers_replaced.items()):
            replaced.add_metric([st.node, action], float(count))
        yield replaced
        up = GaugeMetricFamily("elastictrain_node_up", "1 for this node's current state", labels=["node", "state"])
        up.add_metric([st.node, st.state], 1.0)
        yield up
        yield from self._ledger_metrics()
        ckpt = self._checkpoint()
        if ckpt is not None:
            yield from gauge("elastictrain_checkpoint_step", "Step of the newest valid checkpoint", ckpt[0])
            yield from gauge("elastictrain_checkpoint_age_seconds", "Age of the newest valid checkpoint",
                             max(0.0, time.time() - ckpt[1]))


    def _ledger_metrics(self) -> Iterator[Any]:
        led = self._ledger() if self._ledger is not None else None
        if led is None:
            return
        t = GaugeMetricFamily("elastictrain_time_seconds", "The job's wall time per bucket of its time ledger",
                              labels=["bucket"])
        for bucket, seconds in led.buckets.items():
            t.add_metric([bucket], seconds)
        yield t
        yield GaugeMetricFamily("elastictrain_wall_seconds", "Wall time since the job began", value=led.wall_s)
        if led.ettr is not None:
            yield GaugeMetricFamily("elastictrain_ettr", "Effective training time ratio: useful training time / "
                                    "wall time", value=led.ettr)
        faults = CounterMetricFamily("elastictrain_faults", "Faults that interrupted training, by kind",
                                     labels=["kind"])
        lost = CounterMetricFamily("elastictrain_fault_lost_seconds", "Seconds faults cost (detect, restart, load, "
                                   "recompute), by kind", labels=["kind"])
        by_kind: dict[str, list[float]] = {}
        for f in led.faults:
            by_kind.setdefault(f.kind, []).append(f.lost_s)
        for kind, costs in sorted(by_kind.items()):
            faults.add_metric([kind], float(len(costs)))
            lost.add_metric([kind], sum(costs))
        yield faults
        yield lost
        yield CounterMetricFamily("elastictrain_recomputed_steps", "Steps run again after faults",
                                  value=float(led.recomputed_steps))


class MetricsServer:
    """Serves one collector on http://ADDR:PORT/metrics until closed."""

    def __init__(self, collector: Collector, port: int, addr: str = "0.0.0.0"):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_port
        log.info("metrics endpoint on http://%s:%d/metrics", addr, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
