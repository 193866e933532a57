"""How a snapshot slot travels between nodes (peer replicas of the T0 tier), for the agents' replica servers, their
senders, and a restarting worker that fetches its rank's snapshot from a peer.

A slot is three files (checkpoint/snapshot.py): `slot<k>.bin` (the bytes), `slot<k>.meta` (the layout) and
`slot<k>.json`, its commit marker (step, slot, size, checksum, identity). On the wire it is one HTTP body, the bin's
bytes then the meta's, with the marker and the meta's size in headers, so the receiver knows the size and the
checksum before the first byte.

Sending locks nothing: the sender reads the marker, the meta and the bytes, then the marker again. A worker that
rewrites the slot meanwhile removes its marker first (and commits a new step), so an unchanged marker proves that
the bytes sent are the committed ones; a changed one aborts the transfer before the meta is sent, and the receiver,
short of bytes, commits nothing. Receiving writes the slot in place, like a save: marker removed first, bytes and
meta written, the checksum over the received bytes compared with the marker's, the marker renamed into place last.
A crash, a cut connection or a flipped byte anywhere leaves that slot uncommitted; the other slot stays.
"""

from __future__ import annotations

import http.client
import json
import mmap
import os
import re
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from elastictrain.checkpoint.replica_tls import ReplicaTLS
from elastictrain.checkpoint.snapshot_folders import SLOTS
from elastictrain.errors import ConfigError, SnapshotReplicaError

REPLICAS_DIR = "replicas"
"""In an agent's snapshot folder: `replicas/<source node>/rank<r>/slot<k>.*`, the layout of its own `rank<r>`."""
PEERS_FILE = "peers.json"
"""In an agent's snapshot folder: the job's live replica servers (`PeerList`), kept current by the agent."""
CHUNK_BYTES = 4 << 20
"""Bytes received (and summed) at a time; a multiple of 8 (the checksum sums 64-bit words chunk by chunk)."""
MARKER_HEADER = "X-Snapshot-Marker"
META_HEADER = "X-Snapshot-Meta-Bytes"
AUTH_HEADER = "Authorization"

_MARKER_KEYS = {"step", "slot", "nbytes", "checksum", "identity"}
_NODE = r"[A-Za-z0-9_.:-]{1,255}"
RANK_PATH = re.compile(rf"^(?:{REPLICAS_DIR}/(?P<source>{_NODE})/)?rank(?P<rank>\d+)$")
"""A rank's folder relative to an agent's snapshot folder: its own `rank<r>`, or a replica's."""


def safe_node(name: str) -> bool:
    """Whether a node id can name a folder (torch's `addr_pid_localid`: a host name or address, digits)."""
    return re.fullmatch(_NODE, name) is not None and name not in (".", "..")


@dataclass(frozen=True)
class Peer:
    """One agent's replica server, as published in its etcd node record and listed in `peers.json`."""

    node: str
    host: str
    port: int
    token: str
    """Sent with every request: the server answers only those who read its record in the job's etcd."""
    tls: bool = False
    """Whether the server speaks HTTPS (elastic.replica_tls on its node)."""
    client_tls: Optional[ReplicaTLS] = field(default=None, compare=False, repr=False)
    """This node's TLS files to connect with (never published: the other node's paths mean nothing here)."""

    def record(self) -> dict[str, Any]:
        """What is published (etcd, `peers.json`): all but `client_tls`."""
        return {"node": self.node, "host": self.host, "port": self.port, "token": self.token, "tls": self.tls}

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        """An HTTP(S) connection to the server; SnapshotReplicaError when one side has TLS and the other not."""
        if self.tls and self.client_tls is None:
            raise SnapshotReplicaError(f"{self.node} serves its replicas over TLS and this node has no "
                                       f"elastic.replica_tls to connect with: give every node the same setting")
        if self.client_tls is not None and not self.tls:
            raise SnapshotReplicaError(f"{self.node} serves its replicas without TLS and this node requires it "
                                       f"(elastic.replica_tls): give every node the same setting")
        if self.client_tls is not None:
            try:
                context = self.client_tls.client_context()
            except ConfigError as e:  # checked at the agent's start: a file changed or went away since
                raise SnapshotReplicaError(str(e)) from None
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def auth(self) -> str:
        return f"Bearer {self.token}"


@dataclass
class PeerList:
    """`peers.json`: this node's id, every live agent's replica server (this node's included) and this node's TLS
    files (elastic.replica_tls, for its restarting workers' fetches)."""

    this_node: str
    peers: list[Peer]
    tls: Optional[ReplicaTLS] = None

    def write(self, folder: Path) -> None:
        tmp = folder / f"{PEERS_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the tokens
        with os.fdopen(fd, "w") as f:
            json.dump({"this_node": self.this_node, "peers": [p.record() for p in self.peers],
                       "tls": self.tls.to_dict() if self.tls else None}, f)
        os.replace(tmp, folder / PEERS_FILE)

    @classmethod
    def read(cls, folder: Path) -> Optional["PeerList"]:
        """The list the agent wrote last, its peers set to connect with its TLS files; None when there is none (no
        agent of ours, or no etcd record yet)."""
        try:
            raw = json.loads((folder / PEERS_FILE).read_text())
            tls = ReplicaTLS.from_dict(raw.get("tls"))
            return cls(raw["this_node"], [replace(Peer(**p), client_tls=tls) for p in raw["peers"]], tls)
        except (OSError, ValueError, TypeError, KeyError):
            return None


def read_marker(rank_dir: Path, slot: int) -> Optional[dict[str, Any]]:
    """A slot's commit marker as written (a `SnapshotInfo`'s fields); None when the slot is not committed."""
    try:
        marker = json.loads((rank_dir / f"slot{slot}.json").read_text())
    except (OSError, ValueError):
        return None
    return marker if valid_marker(marker) else None


def valid_marker(marker: Any) -> bool:
    return (isinstance(marker, dict) and set(marker) == _MARKER_KEYS and isinstance(marker["identity"], dict)
            and all(isinstance(marker[k], int) and marker[k] >= 0 for k in ("step", "slot", "nbytes", "checksum")))


def committed_markers(rank_dir: Path) -> list[dict[str, Any]]:
    """The committed slots' markers of one rank folder, newest step first."""
    found = [m for m in (read_marker(rank_dir, k) for k in SLOTS) if m is not None]
    return sorted(found, key=lambda m: -m["step"])


def slot_to_write(rank_dir: Path) -> int:
    """Which of slots 0 and 1 a copy into `rank_dir` (a replica, a fetched snapshot) overwrites: the one with no or
    the older commit, so the newer one stays committed while it is written. Two are enough for a copy: the third
    slot is only for a rank's own snapshots while a durable save reads one of them."""
    held = {m["slot"]: m["step"] for m in committed_markers(rank_dir)}
    return min((0, 1), key=lambda k: held.get(k, -1))


class WordSum:
    """The snapshot checksum (the bytes as 64-bit words summed modulo 2**64, plus the trailing bytes), computed
    chunk by chunk as the bytes stream through; every chunk but the last must be a multiple of 8 bytes."""

    def __init__(self) -> None:
        self._total = 0
        self._ended = False

    def update(self, chunk: memoryview) -> None:
        if self._ended:
            raise ValueError("a chunk after one that was not a multiple of 8 bytes")
        whole = len(chunk) // 8 * 8
        if whole:
            # numpy's integer sum wraps around like torch's in SnapshotStore (the modulo comes at the end); numpy, as
            # torch's sum runs on its thread pool: 18 ms instead of 1 ms per 4 MiB on two busy cores.
            self._total += int(np.frombuffer(chunk[:whole], dtype=np.int64).sum())
        if whole != len(chunk):
            self._total += sum(chunk[whole:])
            self._ended = True

    @property
    def value(self) -> int:
        return self._total % (1 << 64)


GIVE_WAY_PIECE = 16 << 20
"""A push that may have to give way (`SlotReader.send`) asks between pieces of this many bytes: a few ms each."""


class SlotReader:
    """A committed slot opened for sending: marker and meta read, `chunks()` streams the bytes, `unchanged()` then
    says whether what was streamed is what the marker commits."""

    def __init__(self, rank_dir: Path, slot: int, marker: dict[str, Any], meta: bytes):
        self.rank_dir, self.slot, self.marker, self.meta = rank_dir, slot, marker, meta

    @classmethod
    def open(cls, rank_dir: Path, slot: int) -> Optional["SlotReader"]:
        marker = read_marker(rank_dir, slot)
        if marker is None:
            return None
        try:
            meta = (rank_dir / f"slot{slot}.meta").read_bytes()
        except OSError:
            return None
        return cls(rank_dir, slot, marker, meta)

    @property
    def nbytes(self) -> int:
        return int(self.marker["nbytes"])

    def send(self, sock: socket.socket, rate: Optional[int] = None,
             give_way: Optional[Callable[[], bool]] = None) -> bool:
        """Send the slot's bytes on `sock`, copied by the kernel (sendfile): no pass through this process. `rate`:
        at most that many bytes per second on average (in pieces of a tenth of a second's worth). `give_way`: asked
        between pieces (of at most `GIVE_WAY_PIECE` bytes); when it says so the send stops there and returns False
        (the receiver commits nothing). True when every byte went."""
        piece = max(1 << 16, rate // 10) if rate else (GIVE_WAY_PIECE if give_way is not None else self.nbytes)
        sent, started = 0, time.monotonic()
        with open(self.rank_dir / f"slot{self.slot}.bin", "rb") as f:
            while sent < self.nbytes:
                if give_way is not None and give_way():
                    return False
                n = sock.sendfile(f, sent, min(piece, self.nbytes - sent))
                if n == 0:
                    break
                sent += n
                ahead = sent / rate - (time.monotonic() - started) if rate else 0.0
                if ahead > 0:
                    time.sleep(ahead)
        if sent != self.nbytes:
            raise SnapshotReplicaError(f"{self.rank_dir}/slot{self.slot}.bin is shorter than its marker says")
        return True

    def unchanged(self) -> bool:
        return read_marker(self.rank_dir, self.slot) == self.marker


def _read_exactly(read_into: Callable[[memoryview], int], view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = read_into(view[got:])
        if not n:
            raise SnapshotReplicaError(f"the stream ended {len(view) - got} bytes early (the sender stopped: its "
                                       f"slot was rewritten meanwhile, or it died)")
        got += n


def receive_slot(read_into: Callable[[memoryview], int], rank_dir: Path, slot: int, marker: dict[str, Any],
                 meta_bytes: int) -> int:
    """Write a slot streamed as `nbytes` bytes then `meta_bytes` of meta into `rank_dir/slot<slot>.*` and commit it
    as `marker` (renumbered to `slot`) once the bytes match its checksum; returns the checksum.

    SnapshotReplicaError, with the slot left uncommitted, when the stream ends early, the checksum differs, or the
    file system has no room (pages are reserved before the first write).
    """
    nbytes = int(marker["nbytes"])
    rank_dir.mkdir(parents=True, exist_ok=True)
    committed = rank_dir / f"slot{slot}.json"
    committed.unlink(missing_ok=True)  # uncommitted from here on
    path = rank_dir / f"slot{slot}.bin"
    summed = WordSum()
    with open(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+b", buffering=0) as f:
        try:
            if os.fstat(f.fileno()).st_size < nbytes:
                os.ftruncate(f.fileno(), nbytes)  # never shrunk: a reader's mapping of the old bytes stays valid
            if nbytes:
                os.posix_fallocate(f.fileno(), 0, nbytes)  # a write into a full tmpfs mapping would be a SIGBUS
        except OSError as e:
            raise SnapshotReplicaError(f"no room for a {nbytes}-byte snapshot in {rank_dir}: {e}") from None
        if nbytes:
            # Received straight into the file's pages, summed while they are in cache: one copy of the bytes. Not
            # MAP_POPULATE: CPython maps holding the GIL, and populating a GB of pages held every other thread of the
            # agent (the etcd lease's keep-alive among them) for 0.4 s idle, 2.4 s while a node started (its lease
            # lapsed: a restart of every worker). The pages now fault in inside the socket reads, outside the GIL.
            with mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED) as mapped, \
                    memoryview(mapped) as pages:
                for at in range(0, nbytes, CHUNK_BYTES):
                    with pages[at:at + CHUNK_BYTES] as view:
                        _read_exactly(read_into, view)
                        summed.update(view)
    meta = memoryview(bytearray(meta_bytes))
    _read_exactly(read_into, meta)
    if summed.value != marker["checksum"]:
        raise SnapshotReplicaError(f"the bytes of the snapshot of step {marker['step']} do not match its checksum "
                                   f"(sent {marker['checksum']}, received {summed.value})")
    (rank_dir / f"slot{slot}.meta").write_bytes(meta)
    tmp = rank_dir / f"slot{slot}.json.tmp"
    tmp.write_text(json.dumps({**marker, "slot": slot}))
    os.replace(tmp, committed)
    return summed.value


def slot_headers(reader: SlotReader) -> dict[str, str]:
    return {MARKER_HEADER: json.dumps(reader.marker), META_HEADER: str(len(reader.meta)),
            "Content-Length": str(reader.nbytes + len(reader.meta))}


def parse_slot_headers(headers: Any) -> tuple[dict[str, Any], int]:
    """The marker and the meta's size a slot's headers announce; SnapshotReplicaError when they do not add up."""
    try:
        marker = json.loads(headers.get(MARKER_HEADER) or "")
        meta_bytes = int(headers.get(META_HEADER) or "")
        length = int(headers.get("Content-Length") or "")
    except ValueError:
        raise SnapshotReplicaError("a snapshot slot without a valid marker and sizes in its headers") from None
    if not valid_marker(marker) or meta_bytes < 0 or length != marker["nbytes"] + meta_bytes:
        raise SnapshotReplicaError(f"a snapshot slot whose headers do not add up: {marker}, meta {meta_bytes}, "
                                   f"length {length}")
    return marker, meta_bytes


def push(peer: Peer, source: str, rank: int, reader: SlotReader, timeout: float,
         rate: Optional[int] = None, give_way: Optional[Callable[[], bool]] = None) -> Optional[int]:
    """Send `reader`'s slot to `peer` as its replica of `source`'s rank `rank` (at most `rate` bytes/s): the checksum
    the peer confirmed, or None when the slot was rewritten while being sent, or `give_way` stopped the send (the
    peer committed nothing; send it, or the newer one, later).

    SnapshotReplicaError when the peer is unreachable, refuses it, or confirms another checksum.
    """
    conn = peer.connect(timeout)
    try:
        conn.putrequest("PUT", f"/replica/{source}/rank{rank}/slot{reader.slot}", skip_accept_encoding=True)
        for k, v in {**slot_headers(reader), AUTH_HEADER: peer.auth()}.items():
            conn.putheader(k, v)
        conn.endheaders()
        if not reader.send(conn.sock, rate, give_way) or not reader.unchanged():
            return None  # closing the connection one meta short makes the peer drop what it received
        conn.send(reader.meta)
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise SnapshotReplicaError(f"sending to {peer.node} ({peer.host}:{peer.port}) failed: {e}") from None
    finally:
        conn.close()
    if resp.status != 200:
        text = body.decode(errors="replace")
        raise SnapshotReplicaError(f"{peer.node} refused the replica: HTTP {resp.status} {text}")
    confirmed = json.loads(body)["checksum"]
    if confirmed != reader.marker["checksum"]:
        raise SnapshotReplicaError(f"{peer.node} confirmed checksum {confirmed}, the snapshot's is "
                                   f"{reader.marker['checksum']}")
    return confirmed


def _get(peer: Peer, path: str, timeout: float) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = peer.connect(timeout)
    try:
        conn.request("GET", path, headers={AUTH_HEADER: peer.auth()})
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        raise SnapshotReplicaError(f"{peer.node} ({peer.host}:{peer.port}) did not answer: {e}") from None
    if resp.status != 200:
        body = resp.read().decode(errors="replace")
        conn.close()
        raise SnapshotReplicaError(f"{peer.node} answered GET {path} with HTTP {resp.status} {body}")
    return conn, resp


def held(peer: Peer, rank: int, timeout: float) -> list[tuple[str, dict[str, Any]]]:
    """(folder, marker) of every committed slot of global rank `rank` the peer holds: its own `rank<r>` folder's
    and its replicas'."""
    conn, resp = _get(peer, f"/held/{rank}", timeout)
    try:
        entries = json.loads(resp.read())
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise SnapshotReplicaError(f"{peer.node} sent an unreadable listing: {e}") from None
    finally:
        conn.close()
    return [(e["path"], e["marker"]) for e in entries
            if isinstance(e, dict) and RANK_PATH.match(str(e.get("path"))) and valid_marker(e.get("marker"))]


def fetch(peer: Peer, path: str, slot: int, rank_dir: Path, into_slot: int, timeout: float) -> dict[str, Any]:
    """Copy the peer's `path/slot<slot>` into `rank_dir/slot<into_slot>`, checksum checked, and commit it there;
    returns the marker as committed."""
    conn, resp = _get(peer, f"/slot/{path}/{slot}", timeout)
    try:
        marker, meta_bytes = parse_slot_headers(resp.headers)
        receive_slot(resp.readinto, rank_dir, into_slot, marker, meta_bytes)
    except (OSError, http.client.HTTPException) as e:
        raise SnapshotReplicaError(f"copying {path}/slot{slot} from {peer.node} failed: {e}") from None
    finally:
        conn.close()
    return {**marker, "slot": into_slot}
