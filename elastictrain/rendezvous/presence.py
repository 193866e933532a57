"""PresenceLink: a held TCP connection from each agent to a few peer agents, to see a dead agent at once.

The etcd lease (liveness.py) tells a lost node `lease_ttl` seconds after its last keep-alive (5 s by default): the
floor under every node loss. A process that dies, though (SIGKILL, OOM kill, crash), has its sockets closed by the
kernel at once, and a peer holding a connection to it reads the end within milliseconds. So each agent listens on
an ephemeral port of the address the rendezvous reaches it on and holds one idle connection to each of its next
few peers (in node-id order, a ring); when one ends, it connects again: **refused** means nothing listens there any
more, the agent process is gone (its workers die with it: PDEATHSIG), and the link reports the peer gone. Anything
else (a timeout, a route gone with the host, an accepted connection: the agent is alive) leaves the lease to
decide, as before. A frozen or CPU-starved agent keeps its sockets, so it is never reported by this path; a host
that loses power or its network sends nothing and is noticed by its lease, as before.

No data is exchanged: the connections only carry their opening and their end.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 0.5
"""A connect (or the probe after a link ended) that takes longer tells nothing: the lease decides then. Connects
do not block: the one thread goes on watching the other links while a dark host's connect waits out this time."""
RETRY_S = 2.0
"""How long after a failed connect a peer is tried again."""
REPROBES = 3
"""A probe reset by the peer (its agent dying as the probe came: the dying listener took the connection, then reset
it) is made again at once, this many times at most; then the lease decides."""
_TICK_S = 0.2


def ring_successors(nodes: list[str], me: str, count: int) -> list[str]:
    """The `count` nodes after `me` in sorted order, wrapping around (fewer when there are fewer others)."""
    ordered = sorted(set(nodes) | {me})
    i = ordered.index(me)
    others = ordered[i + 1:] + ordered[:i]
    return others[:count]


Address = tuple[str, int]
"""(host, port) of a presence listener, as published in its node record (a JSON pair)."""


class PresenceLink:
    """Listen on `host`; hold connections to the peers `watch` names; call `on_gone(node)` when one's agent died."""

    def __init__(self, host: str, on_gone: Callable[[str], None]) -> None:
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((addr[0], 0))
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.address: Address = (addr[0], self._listener.getsockname()[1])
        self._on_gone = on_gone
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, ("listen", None))
        self._targets: dict[str, Address] = {}
        self._targets_lock = threading.Lock()
        self._links: dict[str, tuple[socket.socket, Address]] = {}
        self._connecting: dict[str, tuple[socket.socket, Address, float, bool]] = {}
        """Connects under way: node -> (socket, address, deadline, whether it probes a link that ended)."""
        self._next_try: dict[str, float] = {}
        self._reprobes: dict[str, int] = {}
        self._reported: set[tuple[str, Address]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="presence-link", daemon=True)
        self._thread.start()

    def watch(self, targets: dict[str, Address]) -> None:
        """Hold links to exactly these peers (node id -> listener address); others are let go."""
        with self._targets_lock:
            self._targets = dict(targets)

    def watched(self) -> set[str]:
        """Peers a link is held to now (connects under way not counted)."""
        return set(self._links)

    def close(self) -> None:
        """Stop the thread, close every link and the listener (peers then see this agent as gone)."""
        self._stop.set()
        self._thread.join(timeout=2)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
                for key, _ in self._selector.select(timeout=_TICK_S):
                    kind, node = key.data
                    if kind == "listen":
                        self._accept()
                    elif kind == "served":
                        self._drain_served(key.fileobj)  # type: ignore[arg-type]
                    elif kind == "connect":
                        self._connect_done(node)
                    else:
                        self._link_ended(node)
                self._expire_connects()
            except Exception:  # noqa: BLE001 - the link is an optimisation: the lease still decides
                log.warning("presence link loop error; going on", exc_info=True)
                self._stop.wait(_TICK_S)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, ("served", None))

    def _drain_served(self, conn: socket.socket) -> None:
        """A peer's link to this agent: it sends nothing, so readable means it ended."""
        try:
            if conn.recv(64):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._selector.unregister(conn)
        conn.close()

    def _sync(self) -> None:
        with self._targets_lock:
            targets = dict(self._targets)
        for node in [n for n, (_, addr) in self._links.items() if targets.get(n) != addr]:
            self._drop(node)
        for node in [n for n, (_, addr, _, _) in self._connecting.items() if targets.get(n) != addr]:
            self._abandon(node)
        now = time.monotonic()
        for node, addr in targets.items():
            if node in self._links or node in self._connecting or now < self._next_try.get(node, 0.0) \
                    or (node, addr) in self._reported:
                continue
            self._start_connect(node, addr, probe=False)

    def _start_connect(self, node: str, addr: Address, probe: bool) -> None:
        """Connect without blocking; the outcome comes to `_connected` (at once, when the kernel knows it already)."""
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)[0]
            conn = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            self._connected(node, addr, None, e.errno or errno.EHOSTUNREACH, probe)
            return
        conn.setblocking(False)
        code = conn.connect_ex(sockaddr)
        if code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
            self._connecting[node] = (conn, addr, time.monotonic() + CONNECT_TIMEOUT_S, probe)
            self._selector.register(conn, selectors.EVENT_WRITE, ("connect", node))
            return
        self._connected(node, addr, conn, code, probe)

    def _take_connect(self, node: str) -> tuple[socket.socket, Address, bool]:
        """A connect under way, no longer waited for: (socket, address, whether it probes)."""
        conn, addr, _, probe = self._connecting.pop(node)
        self._selector.unregister(conn)
        return conn, addr, probe

    def _connect_done(self, node: str) -> None:
        conn, addr, probe = self._take_connect(node)
        self._connected(node, addr, conn, conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), probe)

    def _expire_connects(self) -> None:
        now = time.monotonic()
        for node in [n for n, (_, _, deadline, _) in self._connecting.items() if now >= deadline]:
            conn, addr, probe = self._take_connect(node)
            self._connected(node, addr, conn, errno.ETIMEDOUT, probe)

    def _abandon(self, node: str) -> None:
        self._take_connect(node)[0].close()

    def _connected(self, node: str, addr: Address, conn: socket.socket | None, code: int, probe: bool) -> None:
        """A connect's outcome (`code`: 0 or an errno). Held when accepted; a refused probe (a link that ended and
        nothing listens there now) reports the peer gone; anything else is tried again later, the lease deciding."""
        if code == 0 and conn is not None:
            self._hold(node, addr, conn)
            return
        if conn is not None:
            conn.close()
        if probe and code == errno.ECONNREFUSED:
            self._reprobes.pop(node, None)
            self._reported.add((node, addr))
            log.info("presence link to node %s ended and %s:%d refuses connections: its agent is gone", node, *addr)
            self._on_gone(node)
            return
        if probe and code in (errno.ECONNRESET, errno.ECONNABORTED) and self._reprobes.get(node, 0) < REPROBES:
            # Seen on loopback: a SIGKILLed agent's listener, closing as the probe came, took the connection and
            # reset it. Asked again, the port refuses. (A blocking connect had returned that connection as made.)
            self._reprobes[node] = self._reprobes.get(node, 0) + 1
            self._start_connect(node, addr, probe=True)
            return
        self._reprobes.pop(node, None)
        if probe:
            log.info("presence link to node %s ended; %s:%d did not answer (%s): its lease decides", node, *addr,
                     errno.errorcode.get(code, code))
        self._next_try[node] = time.monotonic() + RETRY_S

    def _hold(self, node: str, addr: Address, conn: socket.socket) -> None:
        self._reprobes.pop(node, None)
        conn.setblocking(False)
        self._links[node] = (conn, addr)
        self._next_try.pop(node, None)
        self._selector.register(conn, selectors.EVENT_READ, ("link", node))

    def _drop(self, node: str) -> None:
        conn, _ = self._links.pop(node)
        self._selector.unregister(conn)
        conn.close()

    def _link_ended(self, node: str) -> None:
        conn, addr = self._links[node]
        try:
            if conn.recv(64):
                return  # a peer sends nothing; ignore anything that comes
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._drop(node)
        self._start_connect(node, addr, probe=True)  # refused: gone; accepted: held again; else the lease decides
