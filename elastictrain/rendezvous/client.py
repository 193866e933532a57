"""EtcdClient: a thin etcd v3 client with endpoint failover, retry with backoff and clear errors.

Built on `pyetcd` (etcd-sdk-python). Every operation the rendezvous needs goes through `call`, which
retries transient failures (no leader, member down, connection refused) with exponential backoff for
up to `outage_tolerance` seconds, so that a short etcd outage never fails a running job, while the
first contact (`connect`) gives up after `connect_timeout` with an error naming the endpoints.

A transient failure may come after etcd applied the request (its reply was lost), so `call` may repeat
a write that already happened. Every write below is therefore either naturally idempotent (repeating it
leaves the same state and result) or made so with a request record (see `_write_once`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from pyetcd import exceptions as etcd_exc
from pyetcd import transactions as tx
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from elastictrain.errors import RendezvousError
from elastictrain.rendezvous.settings import EtcdSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A failed endpoint is retried after this long (pyetcd's default is 300 s, far too long for a
# cluster whose member only restarted).
_ENDPOINT_RETRY_S = 1.0

# Request records live under a lease of at least this long (and 3 retry windows), granted afresh once
# less than 2 retry windows of it are left: one grant every ~8 minutes with the defaults.
_REQUEST_LEASE_MIN_TTL_S = 600.0
# Once a call of a leaving thread (`limit_tolerance`) found etcd down, its later calls retry this long only.
LEAVING_RETRY_S = 0.2
# Counters whose last seen (value, revision) `add` keeps to guess from; the rendezvous touches a few per round.
_COUNTER_CACHE_SIZE = 1024

_TRANSIENT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
_TRANSIENT_EXC = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
)


class EtcdUnavailableError(RendezvousError):
    """etcd stayed unreachable longer than allowed.

    Not a subclass of torch's `RendezvousConnectionError`: that would import torch into every operator command
    (`status`, `events`, ...) that only talks to etcd. The rendezvous handler catches both.
    """


def _grpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error behind a pyetcd exception (pyetcd drops the details)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.RpcError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _describe(exc: BaseException) -> str:
    err = _grpc_error(exc)
    if err is not None and hasattr(err, "code"):
        return f"{err.code().name}: {err.details()}"
    return f"{type(exc).__name__}: {exc}"


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT_EXC):
        return True
    err = _grpc_error(exc)
    return err is not None and hasattr(err, "code") and err.code() in _TRANSIENT_CODES


def _kv(kvs: list[Any]) -> tuple[bytes, int] | None:
    """(value, mod revision) from a transaction's get of one key; None when the key is absent."""
    if not kvs:
        return None
    value, meta = kvs[0]
    return bytes(value), int(meta.mod_revision)


def _is_lease_not_found(exc: BaseException) -> bool:
    err = _grpc_error(exc)
    return (
        err is not None and hasattr(err, "code") and err.code() == grpc.StatusCode.NOT_FOUND
        and "lease not found" in (err.details() or "")
    )


def _is_auth_token_expired(exc: BaseException) -> bool:
    err = _grpc_error(exc)
    return err is not None and hasattr(err, "details") and "invalid auth token" in (err.details() or "")


@dataclass(frozen=True)
class _Outcome:
    """How a write made once ended: whether it is in etcd, and what the branch that ran read."""

    applied: bool
    """The write's ops are in etcd: applied by this attempt, or by an earlier one whose reply was lost."""
    reads: list[Any]
    """Responses of the ops of the branch that ran (the request record's own op left out)."""
    record: bytes
    """What the write recorded when it was applied (empty when it was not)."""


class EtcdClient:
    """etcd v3 operations used by the backend, the store and node liveness; thread safe."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._client: MultiEndpointEtcd3Client | None = None
        self._periodic: dict[float, MultiEndpointEtcd3Client] = {}
        """Clients whose RPC deadline is a `tolerance` block's seconds (see `tolerance`), by those seconds."""
        self._local = threading.local()
        self._lease_lock = threading.Lock()
        self._request_lease_id: int | None = None
        self._request_lease_renew_at = 0.0
        self._counters: dict[str, tuple[int, int]] = {}

    # -- connection -----------------------------------------------------------------------------

    def _build(self, timeout: float) -> MultiEndpointEtcd3Client:
        s = self.settings
        creds = None
        if s.tls:
            creds = MultiEndpointEtcd3Client.get_secure_creds(s.cacert, s.key, s.cert)
        # pyetcd takes an endpoint out of use for `time_retry` s after an RPC on it timed out or failed, so that the
        # next call goes to another member. A lone endpoint has no other: out of use, every call in that second
        # failed at once (NoServerAvailableError), and one slow lease keep-alive cost the next ones too.
        retry = _ENDPOINT_RETRY_S if len(s.endpoints) > 1 else 0.0
        # netloc keeps IPv6 hosts bracketed, as gRPC targets need.
        endpoints = [
            Endpoint(ep.netloc.rsplit(":", 1)[0], ep.port, secure=s.tls, creds=creds, time_retry=retry)
            for ep in s.endpoints
        ]
        client = MultiEndpointEtcd3Client(
            endpoints=endpoints, timeout=timeout, user=s.user, password=s.password, failover=True
        )
        if not s.tls:
            # gRPC refuses call credentials on a plain channel; the auth token still travels as
            # metadata, which is all etcd reads.
            client.call_credentials = None
        return client

    def _raw(self) -> MultiEndpointEtcd3Client:
        periodic = getattr(self._local, "tolerance", None)
        with self._lock:
            if periodic is not None and periodic < self.settings.request_timeout:
                if periodic not in self._periodic:
                    self._periodic[periodic] = self._build(periodic)
                return self._periodic[periodic]
            if self._client is None:
                self._client = self._build(self.settings.request_timeout)
            return self._client

    def _reset(self) -> None:
        with self._lock:
            old = [c for c in (self._client, *self._periodic.values()) if c is not None]
            self._client, self._periodic = None, {}
        for client in old:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken channel may fail; nothing to do
                logger.debug("closing etcd client failed", exc_info=True)

    def connect(self) -> None:
        """Check that etcd answers; raise RendezvousError naming the endpoints within ~connect_timeout."""
        s = self.settings
        deadline = time.monotonic() + s.connect_timeout
        last: BaseException | None = None
        attempt = 0
        # One client while some member is untried: a failed probe marks its member failed in the client, so the next
        # attempt goes to another member of the list. A new client per attempt started on a random member each time,
        # and with one dead member of two, every attempt within connect_timeout could pick it (seen in CI).
        client: MultiEndpointEtcd3Client | None = None
        while True:
            attempt += 1
            try:
                if client is None:
                    client = self._build(min(s.request_timeout, s.connect_timeout))
                client.get(f"{s.run_prefix}/probe")
            except (grpc.RpcError, etcd_exc.Etcd3Exception, OSError) as exc:
                last = exc
                if not _is_transient(exc) or time.monotonic() >= deadline:
                    if client is not None:
                        client.close()
                    if not _is_transient(exc):
                        raise self._fatal_error(exc) from exc
                    break
                if client is not None and (
                    len(client.endpoints) == 1 or all(ep.is_failed() for ep in client.endpoints.values())
                ):
                    # A lone member, or every member tried: fresh channels, so that a server started late is
                    # reached without gRPC's reconnect backoff.
                    client.close()
                    client = None
                time.sleep(min(0.05 * 2**attempt, 1.0, max(deadline - time.monotonic(), 0.0)))
                continue
            with self._lock:
                old, self._client = self._client, client
            if old is not None:
                old.close()
            client.timeout = s.request_timeout
            return
        assert last is not None
        tls_hint = (
            f"TLS is on (cacert={s.cacert}); is the server plain http?"
            if s.tls
            else "TLS is off; if the server uses https pass --rdzv-conf cacert=... and https:// endpoints"
        )
        raise RendezvousError(
            f"cannot reach etcd at {s.endpoints_str()} within {s.connect_timeout:g} s ({_describe(last)}). "
            f"Check the --rdzv-endpoint host and port and that etcd is running; {tls_hint}."
        ) from last

    def _fatal_error(self, exc: BaseException) -> RendezvousError:
        detail = _describe(exc)
        lowered = detail.lower()
        if "authentication failed" in lowered or "user name is empty" in lowered or "permission denied" in lowered:
            hint = "check --rdzv-conf user=... password=... and the user's role on the key prefix"
        elif "ssl" in lowered or "certificate" in lowered or "handshake" in lowered:
            hint = "check --rdzv-conf cacert/cert/key against the server's TLS setup"
        elif isinstance(exc, OSError):
            hint = "check the TLS file paths in --rdzv-conf"
        else:
            hint = "see the cause above"
        return RendezvousError(f"etcd at {self.settings.endpoints_str()} refused us ({detail}); {hint}")

    def close(self) -> None:
        """Close the gRPC channels."""
        self._reset()

    # -- retry ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def tolerance(self, seconds: float) -> Iterator[None]:
        """Within the block, this thread's calls give up after `seconds` instead of `outage_tolerance`.

        For periodic callers (the agent's monitor loop, heartbeats) that must not block for a long
        outage: they skip a beat and try again next time. One RPC then also waits at most `seconds`
        (not `request_timeout`): on a host cut off from etcd every RPC runs to its deadline, and 5 s
        ones held the agent's monitor loop up long enough to miss its own workers' hang.
        """
        previous = getattr(self._local, "tolerance", None)
        self._local.tolerance = seconds
        try:
            yield
        finally:
            self._local.tolerance = previous

    def limit_tolerance(self, seconds: float) -> None:
        """From now on this thread's calls give up after at most `seconds`: an agent leaving on a signal, whose
        last writes (events, status, lease) are best effort and whose scheduler's grace period is short. Without
        it, an agent stopped while etcd was down retried each of them for `outage_tolerance` and outlived
        the grace period (measured: no exit 60 s after SIGTERM)."""
        current = getattr(self._local, "tolerance", None) or self.settings.outage_tolerance
        self._local.tolerance = min(current, seconds)
        self._local.leaving = True

    def call(self, what: str, fn: Callable[[MultiEndpointEtcd3Client], T],
             tolerance: float | None = None) -> T:  # fmt: skip
        """Run `fn(client)`, retrying transient failures with backoff for up to `tolerance` seconds.

        A transient failure may follow a request etcd applied, so `fn` must be safe to repeat.
        """
        if tolerance is None:
            tolerance = getattr(self._local, "tolerance", None) or self.settings.outage_tolerance
        deadline = time.monotonic() + tolerance
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn(self._raw())
            except (grpc.RpcError, etcd_exc.Etcd3Exception) as exc:
                if _is_auth_token_expired(exc) and attempt <= 2:
                    # Simple auth tokens expire after idle time; a fresh client re-authenticates.
                    self._reset()
                    continue
                if not _is_transient(exc):
                    raise self._fatal_error(exc) from exc
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if getattr(self._local, "leaving", False):  # the next calls of a leaving thread try once
                        self._local.tolerance = min(tolerance, LEAVING_RETRY_S)
                    raise EtcdUnavailableError(
                        f"etcd at {self.settings.endpoints_str()} unavailable for {tolerance:g} s during "
                        f"{what} ({_describe(exc)})"
                    ) from exc
                if attempt == 1 or attempt % 10 == 0:
                    logger.warning("etcd %s failed (%s); retrying for up to %.1f s", what, _describe(exc), remaining)
                # Jitter spreads the retries of many agents after an etcd restart.
                time.sleep(min(0.05 * 2 ** min(attempt, 5) * random.uniform(0.5, 1.0), remaining))

    # -- reads ------------------------------------------------------------------------------------

    def get(self, key: str, tolerance: float | None = None) -> tuple[bytes, int] | None:
        """(value, mod_revision) of `key`, or None."""
        value, meta = self.call(f"get {key}", lambda c: c.get(key), tolerance)
        if value is None:
            return None
        return bytes(value), int(meta.mod_revision)

    def get_prefix(self, prefix: str, tolerance: float | None = None) -> dict[str, bytes]:
        """All keys under `prefix` with their values."""
        return {key: value for key, (value, _) in self.get_prefix_revisions(prefix, tolerance).items()}

    def get_prefix_revisions(self, prefix: str, tolerance: float | None = None) -> dict[str, tuple[bytes, int]]:
        """All keys under `prefix` with their values and mod revisions (for a compare-and-swap on each)."""
        items = self.call(f"get prefix {prefix}", lambda c: list(c.get_prefix(prefix)), tolerance)
        return {meta.key.decode(): (bytes(value), int(meta.mod_revision)) for value, meta in items}

    def count_prefix(self, prefix: str) -> int:
        """How many keys live under `prefix`."""
        return len(self.get_prefix(prefix))

    # -- writes that are idempotent as they are ---------------------------------------------------

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        """Write `key` (bound to `lease` when given).

        Idempotent: a repeat writes the same bytes to the same key. A write by someone else between an
        applied attempt and its repeat raced with this call anyway, so either order was possible.
        """
        self.call(f"put {key}", lambda c: c.put(key, value, lease=lease))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under `prefix` (idempotent: a repeat finds fewer keys or none; nothing is returned)."""
        self.call(f"delete prefix {prefix}", lambda c: c.delete_prefix(prefix))

    # -- writes made once with a request record ---------------------------------------------------

    def cas(self, key: str, value: bytes, expected_revision: int | None) -> tuple[bool, bytes | None, int]:
        """Write `value` iff `key`'s mod revision is `expected_revision` (None: iff absent).

        Returns (written, current value, current mod revision); the current value is None when the
        key does not exist. `written` is also true when an attempt whose reply was lost wrote it (its
        repeat alone would see the changed revision and report a lost race).
        """
        guard = tx.Version(key) == 0 if expected_revision is None else tx.Mod(key) == expected_revision
        # The get in the same transaction returns the revision our write produced (or the one that
        # beat us), so the caller never needs a second, racy read.
        outcome = self._write_once(
            f"compare-and-swap {key}", self._new_request(), [guard], [tx.Put(key, value), tx.Get(key)], [tx.Get(key)]
        )
        current = _kv(outcome.reads[-1])
        if current is None:
            return outcome.applied, None, 0
        return outcome.applied, current[0], current[1]

    def delete(self, key: str) -> bool:
        """Delete `key`; True when it existed (also when a lost reply hid that this call deleted it)."""
        outcome = self._write_once(f"delete {key}", self._new_request(), [tx.Version(key) > 0], [tx.Delete(key)], [])
        return outcome.applied

    def delete_if_revision(self, key: str, revision: int) -> bool:
        """Delete `key` iff its mod revision is still `revision`; True when this call deleted it."""
        what = f"conditional delete {key}"
        return self._write_once(what, self._new_request(), [tx.Mod(key) == revision], [tx.Delete(key)], []).applied

    def move(self, key: str, revision: int, to: str, value: bytes) -> bool:
        """Delete `key` and write `to` in one transaction, iff `key`'s mod revision is still `revision`; True when
        this call did it (a claim: of two callers racing for the same key, one wins)."""
        what = f"move {key} to {to}"
        compare, success = [tx.Mod(key) == revision], [tx.Delete(key), tx.Put(to, value)]
        return self._write_once(what, self._new_request(), compare, success, []).applied

    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer stored at `key` (absent: 0); return the new value.

        One transaction when the key is unchanged since this client's last add to it; else a read
        first (a wrong guess would cost a failed transaction, which etcd logs like a write).
        """
        if amount == 0:
            return self._read_counter(key)
        # One request for every guess: the record of an applied guess stops all later ones.
        request = self._new_request()
        seen = self._counters.get(key) or self._remember(key, self.get(key))
        while True:
            base = 0 if seen is None else seen[0]
            guard = tx.Version(key) == 0 if seen is None else tx.Mod(key) == seen[1]
            new = str(base + amount).encode()
            write = [tx.Put(key, new), tx.Get(key)]
            outcome = self._write_once(f"add {key}", request, [guard], write, [tx.Get(key)], record=new)
            seen = self._remember(key, _kv(outcome.reads[-1]))
            if outcome.applied:
                return int(outcome.record)

    def _read_counter(self, key: str) -> int:
        """`add(key, 0)`: the value; an absent key is created as 0 (idempotent: a repeat creates nothing)."""
        current = self.get(key)
        if current is None:

            def create(c: MultiEndpointEtcd3Client) -> tuple[bool, list[Any]]:
                return c.transaction(
                    compare=[tx.Version(key) == 0], success=[tx.Put(key, b"0"), tx.Get(key)], failure=[tx.Get(key)]
                )

            current = _kv(self.call(f"create counter {key}", create)[1][-1])
        seen = self._remember(key, current)
        return 0 if seen is None else seen[0]

    def _remember(self, key: str, current: tuple[bytes, int] | None) -> tuple[int, int] | None:
        """Keep a counter's (value, mod revision) as last read, to guess the next add from."""
        if current is None:
            self._counters.pop(key, None)
            return None
        if len(self._counters) >= _COUNTER_CACHE_SIZE:
            self._counters.clear()
        seen = self._counters[key] = (int(current[0]), current[1])
        return seen

    def _new_request(self) -> str:
        return f"{self.settings.run_prefix}/requests/{uuid.uuid4().hex}"

    def _write_once(self, what: str, request: str, compare: list[Any], success: list[Any], failure: list[Any],
                    record: bytes = b"") -> _Outcome:  # fmt: skip
        """Run a write transaction that is applied at most once, however often `call` repeats it.

        The transaction also creates the key `request`, and runs `success` only while that key is
        absent. A repeat of an applied attempt therefore takes the `failure` branch and finds the
        record (with `record`, the result to return) instead of writing again.
        """
        attempt = functools.partial(self._transact_recorded, what, request, compare, success, failure, record)
        try:
            return attempt(self._request_lease())
        except RendezvousError as exc:
            if not _is_lease_not_found(exc):
                raise
            # etcd refused the whole transaction: the records' lease is gone (etcd restored from a
            # backup, revoked by hand). Nothing was written; take a new lease.
            self._forget_request_lease()
            return attempt(self._request_lease())

    def _transact_recorded(self, what: str, request: str, compare: list[Any], success: list[Any],
                           failure: list[Any], record: bytes, lease: int) -> _Outcome:  # fmt: skip
        def txn(c: MultiEndpointEtcd3Client) -> tuple[bool, list[Any]]:
            return c.transaction(
                compare=[*compare, tx.Version(request) == 0],
                success=[*success, tx.Put(request, record, lease=lease)],
                failure=[*failure, tx.Get(request)],
            )

        succeeded, responses = self.call(what, txn)
        if succeeded:
            return _Outcome(True, responses[:-1], record)
        found = responses[-1]
        return _Outcome(bool(found), responses[:-1], bytes(found[0][0]) if found else b"")

    def _request_lease(self) -> int:
        """The lease for request records: it outlives every retry window that starts now."""
        with self._lease_lock:
            if self._request_lease_id is None or time.monotonic() >= self._request_lease_renew_at:
                window = self.settings.outage_tolerance + self.settings.request_timeout
                ttl = max(_REQUEST_LEASE_MIN_TTL_S, 3 * window)
                # Timed from before the grant: etcd starts the lease later, never earlier.
                started = time.monotonic()
                self._request_lease_id = self.lease_grant(math.ceil(ttl))
                self._request_lease_renew_at = started + ttl - 2 * window
            return self._request_lease_id

    def _forget_request_lease(self) -> None:
        with self._lease_lock:
            self._request_lease_id = None

    # -- leases and watches -----------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        """Grant a lease of `ttl` seconds; return its id.

        A repeat after a lost reply grants a second lease; the first one has no keys (they are put
        after this returns) and expires by itself, so a repeat changes nothing anyone reads.
        """
        return int(self.call("lease grant", lambda c: c.lease(ttl)).id)

    def lease_refresh(self, lease_id: int, tolerance: float | None = None) -> int:
        """Refresh a lease; return its remaining TTL (0 or less: the lease is gone).

        Idempotent: a repeated keep-alive sets the same TTL again.
        """
        responses = self.call("lease keep-alive", lambda c: list(c.refresh_lease(lease_id)), tolerance)
        return int(responses[0].TTL) if responses else 0

    def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting the keys bound to it; a lease already gone counts as revoked."""

        def revoke(c: MultiEndpointEtcd3Client) -> None:
            try:
                c.revoke_lease(lease_id)
            except grpc.RpcError as exc:
                # Expired, or revoked by an attempt whose reply was lost: what we asked for holds.
                if not _is_lease_not_found(exc):
                    raise

        self.call("lease revoke", revoke, tolerance=self.settings.request_timeout)

    def watch_prefix(self, prefix: str, callback: Callable[[Any], None], tolerance: float | None = None) -> int:
        """Call `callback(response_or_exception)` for every change under `prefix`; return the watch id.

        A broken stream (etcd restart, member failover) reaches the callback as an exception or None;
        the caller then watches again.
        """
        return int(self.call(f"watch {prefix}", lambda c: c.add_watch_prefix_callback(prefix, callback), tolerance))

    def cancel_watch(self, watch_id: int) -> None:
        """Stop a watch; ignore errors (the watcher may already be gone)."""
        try:
            self._raw().cancel_watch(watch_id)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.debug("cancel watch %s failed", watch_id, exc_info=True)
