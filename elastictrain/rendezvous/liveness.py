"""NodeLiveness: a lease-bound node record per agent, kept alive in the background, and a watch on peers.

An agent that dies (SIGKILL, power off, network cut) stops refreshing its lease; etcd deletes its
record `lease_ttl` seconds later and every survivor's watch sees the deletion at once. This replaces
torch's own liveness signal (a timestamp rewritten into the shared state every 5 s, judged after
3 misses = 15 s) as the fast path; torch's stays as a fallback.

With a presence host, a dead agent is seen faster still: each agent holds an idle TCP connection to a few peers
(presence.py), and a peer whose connection ends and whose port then refuses connections is gone; its lease is
revoked at once (its record carries the lease id), so every node's watch sees it lost without waiting for the TTL.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pyetcd import events as etcd_events

from elastictrain.rendezvous.client import EtcdClient, EtcdUnavailableError
from elastictrain.rendezvous.presence import PresenceLink, ring_successors

PRESENCE_PEERS = 3
"""How many peers (the next ones in node-id order) each agent holds a presence link to: a dead agent is seen by
this many others, and any one of them revokes its lease."""

logger = logging.getLogger(__name__)


class NodeLiveness:
    """Register this node under `<prefix>/<node_id>` with a lease; track which peers are alive."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        node_id: str,
        ttl: int,
        on_change: Callable[[], None] | None = None,
        presence_host: str | None = None,
    ) -> None:
        self._client = client
        self._prefix = prefix.rstrip("/") + "/"
        self.node_id = node_id
        self._ttl = ttl
        self.on_change = on_change
        self._lease_id: int | None = None
        self._alive: set[str] = set()
        self._alive_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch_id: int | None = None
        self._watch_broken = threading.Event()
        self._info: dict[str, Any] = {}
        self._records: dict[str, dict[str, Any]] = {}
        self._records_lock = threading.Lock()
        """The watch thread and the keep-alive loop (its reseed) both replace `_records`: taken for the whole
        read-modify-write, so that neither puts back what the other removed or drops what it added. Before
        `_alive_lock` when both are held."""
        self._presence_host = presence_host
        self._presence: PresenceLink | None = None

    @property
    def key(self) -> str:
        """This node's record key."""
        return self._prefix + self.node_id

    def start(self) -> None:
        """Write the record under a fresh lease, seed the peer set, start the watch and the keep-alive thread."""
        self._start_presence()
        self._register()
        self._start_watch()
        self._reseed()
        self._thread = threading.Thread(target=self._run, name=f"etcd-liveness-{self.node_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing and revoke the lease so peers see us leave at once; safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        watch_id, self._watch_id = self._watch_id, None
        if watch_id is not None:
            self._client.cancel_watch(watch_id)
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                self._client.lease_revoke(lease_id)
            except Exception:  # noqa: BLE001 - etcd may be gone at exit; the lease expires anyway
                logger.debug("lease revoke failed", exc_info=True)
        presence, self._presence = self._presence, None
        if presence is not None:
            presence.close()

    def publish(self, **info: Any) -> None:
        """Add fields to this node's record (e.g. where its snapshot replica server listens), bound to its lease."""
        self._info.update(info)
        if self._lease_id is not None:
            self._client.put(self.key, self._record(), lease=self._lease_id)

    def alive_nodes(self) -> set[str]:
        """Node ids whose record this process has seen and not seen deleted."""
        with self._alive_lock:
            return set(self._alive)

    def confirm_alive(self, node_ids: set[str]) -> set[str]:
        """Ask etcd (not the watch cache) which of `node_ids` are alive; on an etcd error assume all are."""
        try:
            records = self._client.get_prefix(self._prefix, tolerance=self._client.settings.request_timeout)
        except EtcdUnavailableError:
            return set(node_ids)
        present = {k[len(self._prefix):] for k in records}
        with self._alive_lock:
            self._alive = present
        return node_ids & present

    def lost(self, node_ids: set[str]) -> set[str]:
        """Which of `node_ids` are gone, confirmed against etcd (a cache miss alone is not proof)."""
        suspects = node_ids - self.alive_nodes() - {self.node_id}
        if not suspects:
            return set()
        return suspects - self.confirm_alive(suspects)

    def watched(self) -> set[str]:
        """Peers this agent holds a presence link to now (empty without a presence host)."""
        return self._presence.watched() if self._presence is not None else set()

    def _record(self) -> bytes:
        return json.dumps(
            {**self._info, "node": self.node_id, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
             "lease": self._lease_id}
        ).encode()

    def _start_presence(self) -> None:
        if self._presence_host is None:
            return
        try:
            self._presence = PresenceLink(self._presence_host, self._peer_gone)
        except OSError as e:
            logger.warning("no presence link on %s (%s): lost nodes are noticed by their etcd lease only (set "
                           "--local-addr to an address of this node that the other nodes reach)",
                           self._presence_host, e)
            return
        self._info["presence"] = list(self._presence.address)

    def _update_records(self, records: dict[str, dict[str, Any]]) -> None:
        """Remember the peers' records (their presence address and lease) and link to this node's ring successors."""
        self._records = records
        if self._presence is None:
            return
        addresses = {n: (r["presence"][0], int(r["presence"][1])) for n, r in records.items()
                     if isinstance(r.get("presence"), list) and len(r["presence"]) == 2}
        successors = ring_successors(list(addresses), self.node_id, PRESENCE_PEERS)
        self._presence.watch({n: addresses[n] for n in successors if n != self.node_id})

    def _peer_gone(self, node: str) -> None:
        """A peer's agent died (its presence link ended, its port refuses): revoke its lease, which every node's
        watch then reports as lost, instead of waiting for the lease's TTL."""
        lease = self._records.get(node, {}).get("lease")
        if not isinstance(lease, int) or not self.confirm_alive({node}):
            return  # an agent that stopped cleanly revoked its own lease first: its record is gone already
        try:
            self._client.lease_revoke(lease)
        except Exception as e:  # noqa: BLE001 - already revoked or expired (NOT_FOUND), or etcd blinked: the TTL ends it
            logger.info("could not revoke the lease of gone node %s (%s); it expires with its TTL", node, e)
            return
        logger.warning("node %s's agent is gone (its presence link ended and its port refuses connections): revoked "
                       "its etcd lease without waiting %s s for it to expire", node, self._ttl)

    def _register(self) -> None:
        self._lease_id = self._client.lease_grant(self._ttl)
        self._client.put(self.key, self._record(), lease=self._lease_id)
        with self._alive_lock:
            self._alive.add(self.node_id)
        logger.info("node %s registered with lease %x (ttl %s s)", self.node_id, self._lease_id, self._ttl)

    def _start_watch(self) -> None:
        try:
            # Bounded: this runs in the keep-alive loop, which must keep its rhythm during an outage.
            tolerance = max(self._ttl / 3.0, 0.5)
            self._watch_id = self._client.watch_prefix(self._prefix, self._on_watch, tolerance)
            self._watch_broken.clear()
        except Exception:  # noqa: BLE001 - the periodic reseed covers a missing watch
            logger.warning("cannot watch %s; relying on periodic reads", self._prefix, exc_info=True)
            self._watch_broken.set()

    def _reseed(self) -> None:
        try:
            records = self._client.get_prefix(self._prefix, tolerance=self._client.settings.request_timeout)
        except EtcdUnavailableError:
            return
        present = {k[len(self._prefix):] for k in records}
        with self._records_lock:
            self._update_records({k[len(self._prefix):]: _parse(v) for k, v in records.items()})
            with self._alive_lock:
                changed = present != self._alive
                self._alive = present
        if changed and self.on_change is not None:
            self.on_change()

    def _on_watch(self, response: Any) -> None:
        if response is None or isinstance(response, Exception):
            # pyetcd reports a broken watch stream (etcd restart) this way; re-establish it later.
            self._watch_broken.set()
            return
        changed = False
        with self._records_lock:
            records = dict(self._records)
            with self._alive_lock:
                for event in response.events:
                    node = event.key.decode()[len(self._prefix):]
                    if isinstance(event, etcd_events.DeleteEvent):
                        logger.info("node record %s deleted (lease expired or revoked)", node)
                        self._alive.discard(node)
                        records.pop(node, None)
                        changed = True
                    else:
                        records[node] = _parse(event.value)
                        if node not in self._alive:
                            self._alive.add(node)
                            changed = True
            self._update_records(records)
        if changed and self.on_change is not None:
            self.on_change()

    def _run(self) -> None:
        interval = max(self._ttl / 3.0, 0.5)
        renewed = time.monotonic()
        while not self._stop.wait(interval):
            try:
                # Bounded retries: the loop itself retries, and a refresh late by more than the
                # TTL is useless anyway.
                remaining = self._client.lease_refresh(self._lease_id or 0, tolerance=interval)
                renewed = self._renewed(renewed, remaining, interval)
                if remaining <= 0:
                    # Our lease expired (e.g. we were cut off longer than the TTL): peers have
                    # dropped us; re-register so that we can join the next round.
                    logger.warning("lease of node %s expired; registering again", self.node_id)
                    self._register()
                if self._watch_broken.is_set():
                    if self._watch_id is not None:
                        self._client.cancel_watch(self._watch_id)
                    self._start_watch()
                self._reseed()
            except Exception as exc:  # noqa: BLE001 - keep the thread alive through etcd outages
                logger.warning("keep-alive of node %s failed (%s); retrying", self.node_id, exc)

    def _renewed(self, previous: float, remaining: int, interval: float) -> float:
        """When this renewal returned; a warning when it came more than half the TTL after the one before (the next
        delay of that kind can cost the lease, and peers then count this live node as lost)."""
        now = time.monotonic()
        gap = now - previous
        if remaining > 0 and gap > self._ttl / 2:
            logger.warning("lease of node %s renewed %.1f s after the previous renewal (ttl %s s, renewed every %.1f "
                           "s): etcd or this agent was slow to answer (etcd's disk busy with other writes, CPU "
                           "starved); a longer rendezvous lease_ttl rides it out", self.node_id, gap, self._ttl,
                           interval)
        return now


def _parse(value: Any) -> dict[str, Any]:
    """A node record's JSON (an empty dict for one that is not: an older agent's, a torn write)."""
    try:
        record = json.loads(value)
    except (TypeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
