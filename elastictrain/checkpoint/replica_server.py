"""The agent's replica server: receives peer nodes' snapshot replicas into its snapshot folder, and serves what the
folder holds (its workers' snapshots and its replicas) to a restarting worker of any node.

HTTP (stdlib, one thread per request) between agents rather than gloo on a side process group: the agent outlives
its workers' crashes, the transfer stays off the training path and out of the process groups that every re-form
rebuilds, and files stream as they are. Requests carry the token the server published in its etcd node record.

    PUT /replica/<source node>/rank<r>/slot<k>   a slot (replica_wire's body), committed as
                                                 `replicas/<source>/rank<r>/slot<k>` once its checksum matches;
                                                 answers {"checksum": c}. A replica of rank r replaces any other
                                                 source's replica of r (that node's ranks went elsewhere).
    GET  /held/<r>                               [{"path", "marker"}] of every committed slot of global rank r
    GET  /slot/<path>/<k>                        one slot (`path` from the listing), marker in the headers
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
import shutil
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from socketserver import TCPServer, ThreadingMixIn
from typing import Any, Iterator, Optional

from elastictrain.checkpoint.replica_tls import ReplicaTLS
from elastictrain.checkpoint.replica_wire import (
    AUTH_HEADER,
    RANK_PATH,
    REPLICAS_DIR,
    Peer,
    SlotReader,
    committed_markers,
    parse_slot_headers,
    receive_slot,
    safe_node,
    slot_headers,
    slot_to_write,
)
from elastictrain.checkpoint.snapshot_folders import SLOTS
from elastictrain.errors import SnapshotReplicaError

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 60.0
"""A sender or reader that stops for this long frees its server thread (its slot stays uncommitted)."""

_PUT = re.compile(r"^/replica/(?P<source>[^/]+)/rank(?P<rank>\d+)/slot(?P<slot>[0-9])$")


class _HTTPServer(ThreadingMixIn, TCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, owner: "ReplicaServer", tls: Optional[ssl.SSLContext]):
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        self.address_family = family
        self.owner, self.tls = owner, tls
        super().__init__((addr[0], 0), _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """With TLS, the handshake runs here, on the request's own thread: a client that stalls in it holds only
        that thread (bounded by the request timeout), never the accept loop."""
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(REQUEST_TIMEOUT_S)
        try:
            wrapped = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as e:
            log.warning("replica server: TLS handshake with %s failed: %s", client_address[0], e)
            request.close()
            return None
        try:
            super().finish_request(wrapped, client_address)
        finally:
            wrapped.close()
        return None


class ReplicaServer:
    """Serves and receives snapshot slots for the agent's folder on `host` (the node's address peers reach)."""

    def __init__(self, folder: Path, host: str, node: str, token: str, tls: Optional[ReplicaTLS] = None):
        """`tls`: serve HTTPS, clients' certificates required (elastic.replica_tls)."""
        self.folder, self.node, self.token, self.tls = folder, node, token, tls
        self.write_lock = threading.Lock()
        """One replica written at a time (a ring gives a node one sender; this also orders a late retry)."""
        self._serving = 0
        self._serving_lock = threading.Lock()
        self._httpd = _HTTPServer(host, self, tls.server_context() if tls is not None else None)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="snapshot-replica-server", daemon=True)
        self._thread.start()
        log.info("snapshot replica server of node %s listening on %s:%d%s", node, *self.address,
                 " (TLS)" if tls is not None else "")

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def peer(self) -> Peer:
        """How peers reach this server."""
        host, port = self.address
        return Peer(node=self.node, host=host, port=port, token=self.token, tls=self.tls is not None,
                    client_tls=self.tls)

    @property
    def serving(self) -> int:
        """How many slots are being copied from this server now (a restoring worker's fetch): this node's own
        replica pushes give way meanwhile (agent/replication.py)."""
        return self._serving

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Counted in `serving` while a slot is being sent to a restoring worker."""
        with self._serving_lock:
            self._serving += 1
        try:
            yield
        finally:
            with self._serving_lock:
                self._serving -= 1

    def held(self, rank: int) -> list[dict[str, Any]]:
        """Every committed slot of global rank `rank` in the folder: the rank's own, then each replica's."""
        dirs = [f"rank{rank}"]
        try:
            dirs += [f"{REPLICAS_DIR}/{d.name}/rank{rank}" for d in sorted((self.folder / REPLICAS_DIR).iterdir())]
        except OSError:
            pass
        return [{"path": p, "marker": m} for p in dirs for m in committed_markers(self.folder / p)]

    def prune(self, source: str, rank: int) -> None:
        """Drop the other sources' replicas of `rank`: its newer snapshots come from `source` now."""
        try:
            others = [d for d in (self.folder / REPLICAS_DIR).iterdir() if d.name != source]
        except OSError:
            return
        for d in others:
            if (d / f"rank{rank}").exists():
                log.info("dropping node %s's replica of rank %d: node %s now sends that rank", d.name, rank, source)
                shutil.rmtree(d / f"rank{rank}", ignore_errors=True)
            try:
                d.rmdir()  # only once empty
            except OSError:
                pass

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("replica server: " + format, *args)

    @property
    def owner(self) -> ReplicaServer:
        return self.server.owner

    def _answer(self, status: int, body: Any) -> None:
        data = (json.dumps(body) if status == 200 else str(body)).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if status == 200 else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client is gone (a sender that aborted its transfer)
            self.close_connection = True

    def _authorized(self) -> bool:
        if hmac.compare_digest(self.headers.get(AUTH_HEADER, ""), f"Bearer {self.owner.token}"):
            return True
        self.close_connection = True
        self._answer(403, "this request does not carry the token of the server's etcd node record")
        return False

    def do_PUT(self) -> None:
        if not self._authorized():
            return
        m = _PUT.match(self.path)
        if m is None or not safe_node(m["source"]):
            self.close_connection = True
            return self._answer(404, f"no such replica path: {self.path}")
        try:
            marker, meta_bytes = parse_slot_headers(self.headers)
        except SnapshotReplicaError as e:
            self.close_connection = True
            return self._answer(400, e)
        source, rank = m["source"], int(m["rank"])
        dest = self.owner.folder / REPLICAS_DIR / source / f"rank{rank}"
        with self.owner.write_lock:
            try:
                # The sender's slot number is not kept: two replica slots per rank, whichever slot it came from.
                checksum = receive_slot(self.rfile.readinto, dest, slot_to_write(dest), marker, meta_bytes)
            except SnapshotReplicaError as e:
                log.warning("replica of node %s's rank %d (step %d) refused: %s", source, rank, marker["step"], e)
                self.close_connection = True
                return self._answer(422, e)
            except OSError as e:
                log.info("replica of node %s's rank %d not received: %s", source, rank, e)
                self.close_connection = True
                return
            self.owner.prune(source, rank)
        self._answer(200, {"checksum": checksum})

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path.startswith("/held/") and self.path[len("/held/"):].isdigit():
            return self._answer(200, self.owner.held(int(self.path[len("/held/"):])))
        rel, _, slot = self.path[len("/slot/"):].rpartition("/") if self.path.startswith("/slot/") else ("", "", "")
        m = RANK_PATH.match(rel)
        reader = None
        if m is not None and slot.isdigit() and int(slot) in SLOTS and (m["source"] is None or safe_node(m["source"])):
            reader = SlotReader.open(self.owner.folder / rel, int(slot))
        if reader is None:
            return self._answer(404, f"no committed snapshot slot at {self.path}")
        with self.owner.copying():
            self._send_slot(reader)

    def _send_slot(self, reader: SlotReader) -> None:
        self.send_response(200)
        for k, v in slot_headers(reader).items():
            self.send_header(k, v)
        self.end_headers()
        try:
            reader.send(self.connection)
            if reader.unchanged():
                self.wfile.write(reader.meta)
            else:  # rewritten while being sent: cut the body short, the reader commits nothing
                log.debug("slot %s/slot%d was rewritten while being served", reader.rank_dir, reader.slot)
        except (OSError, SnapshotReplicaError) as e:
            log.debug("serving %s/slot%d stopped: %s", reader.rank_dir, reader.slot, e)
        self.close_connection = True
