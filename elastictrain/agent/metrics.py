"""Prometheus metrics endpoint of one agent (`elastictrain run --metrics-port PORT`; 0, the default, is off).

Values are read at scrape time from the status the agent already publishes to etcd, so a scrape costs no
training time. The checkpoint age needs a listing of the checkpoint root: it is cached for `ckpt_cache_s`.

    elastictrain_step                          newest global step reported by this node's workers
    elastictrain_step_time_seconds             calibrated (p95) step time
    elastictrain_restarts_used / _max          the job-wide restart budget
    elastictrain_worker_heartbeat_age_seconds  per local rank, seconds since its last heartbeat
    elastictrain_checkpoint_step / _age_seconds the newest valid checkpoint
    elastictrain_node_up{state}                1 for this node's current state
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

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
                 ckpt_cache_s: float = DEFAULT_CKPT_CACHE_S):
        self._snapshot, self._url, self._cache_s = snapshot, ckpt_url, ckpt_cache_s
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
        ckpt = self._checkpoint()
        if ckpt is not None:
            yield from gauge("elastictrain_checkpoint_step", "Step of the newest valid checkpoint", ckpt[0])
            yield from gauge("elastictrain_checkpoint_age_seconds", "Age of the newest valid checkpoint",
                             max(0.0, time.time() - ckpt[1]))


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
