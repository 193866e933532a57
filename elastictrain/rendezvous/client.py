"""EtcdClient: a thin etcd v3 client with endpoint failover, retry with backoff and clear errors.

Built on `pyetcd` (etcd-sdk-python). Every operation the rendezvous needs goes through `_call`, which
retries transient failures (no leader, member down, connection refused) with exponential backoff for
up to `outage_tolerance` seconds, so that a short etcd outage never fails a running job, while the
first contact (`connect`) gives up after `connect_timeout` with an error naming the endpoints.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
from pyetcd import exceptions as etcd_exc
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastictrain.errors import RendezvousError
from elastictrain.rendezvous.settings import EtcdSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A failed endpoint is retried after this long (pyetcd's default is 300 s, far too long for a
# cluster whose member only restarted).
_ENDPOINT_RETRY_S = 1.0

_TRANSIENT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
_TRANSIENT_EXC = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
)


class EtcdUnavailableError(RendezvousError, RendezvousConnectionError):
    """etcd stayed unreachable longer than allowed; torch's agent treats it as a connection error."""


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


def _is_auth_token_expired(exc: BaseException) -> bool:
    err = _grpc_error(exc)
    return err is not None and hasattr(err, "details") and "invalid auth token" in (err.details() or "")


class EtcdClient:
    """etcd v3 operations used by the backend, the store and node liveness; thread safe."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._client: MultiEndpointEtcd3Client | None = None
        self._local = threading.local()

    # -- connection -----------------------------------------------------------------------------

    def _build(self, timeout: float) -> MultiEndpointEtcd3Client:
        s = self.settings
        creds = None
        if s.tls:
            creds = MultiEndpointEtcd3Client.get_secure_creds(s.cacert, s.key, s.cert)
        # netloc keeps IPv6 hosts bracketed, as gRPC targets need.
        endpoints = [
            Endpoint(ep.netloc.rsplit(":", 1)[0], ep.port, secure=s.tls, creds=creds, time_retry=_ENDPOINT_RETRY_S)
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
        with self._lock:
            if self._client is None:
                self._client = self._build(self.settings.request_timeout)
            return self._client

    def _reset(self) -> None:
        with self._lock:
            old, self._client = self._client, None
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - closing a broken channel may fail; nothing to do
                logger.debug("closing etcd client failed", exc_info=True)

    def connect(self) -> None:
        """Check that etcd answers; raise RendezvousError naming the endpoints within ~connect_timeout."""
        s = self.settings
        deadline = time.monotonic() + s.connect_timeout
        last: BaseException | None = None
        attempt = 0
        while True:
            attempt += 1
            client: MultiEndpointEtcd3Client | None = None
            try:
                client = self._build(min(s.request_timeout, s.connect_timeout))
                client.get(f"{s.run_prefix}/probe")
            except (grpc.RpcError, etcd_exc.Etcd3Exception, OSError) as exc:
                if client is not None:
                    client.close()
                last = exc
                if not _is_transient(exc):
                    raise self._fatal_error(exc) from exc
                if time.monotonic() >= deadline:
                    break
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
        outage: they skip a beat and try again next time.
        """
        previous = getattr(self._local, "tolerance", None)
        self._local.tolerance = seconds
        try:
            yield
        finally:
            self._local.tolerance = previous

    def call(self, what: str, fn: Callable[[MultiEndpointEtcd3Client], T],
             tolerance: float | None = None) -> T:  # fmt: skip
        """Run `fn(client)`, retrying transient failures with backoff for up to `tolerance` seconds."""
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
                    raise EtcdUnavailableError(
                        f"etcd at {self.settings.endpoints_str()} unavailable for {tolerance:g} s during "
                        f"{what} ({_describe(exc)})"
                    ) from exc
                if attempt == 1 or attempt % 10 == 0:
                    logger.warning("etcd %s failed (%s); retrying for up to %.1f s", what, _describe(exc), remaining)
                # Jitter spreads the retries of many agents after an etcd restart.
                time.sleep(min(0.05 * 2 ** min(attempt, 5) * random.uniform(0.5, 1.0), remaining))

    # -- operations -------------------------------------------------------------------------------

    def get(self, key: str, tolerance: float | None = None) -> tuple[bytes, int] | None:
        """(value, mod_revision) of `key`, or None."""
        value, meta = self.call(f"get {key}", lambda c: c.get(key), tolerance)
        if value is None:
            return None
        return bytes(value), int(meta.mod_revision)

    def get_prefix(self, prefix: str, tolerance: float | None = None) -> dict[str, bytes]:
        """All keys under `prefix` with their values."""
        items = self.call(f"get prefix {prefix}", lambda c: list(c.get_prefix(prefix)), tolerance)
        return {meta.key.decode(): bytes(value) for value, meta in items}

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        """Write `key` (bound to `lease` when given)."""
        self.call(f"put {key}", lambda c: c.put(key, value, lease=lease))

    def delete(self, key: str) -> bool:
        """Delete `key`; True when it existed."""
        return bool(self.call(f"delete {key}", lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under `prefix`."""
        self.call(f"delete prefix {prefix}", lambda c: c.delete_prefix(prefix))

    def count_prefix(self, prefix: str) -> int:
        """How many keys live under `prefix`."""
        return len(self.get_prefix(prefix))

    def cas(self, key: str, value: bytes, expected_revision: int | None) -> tuple[bool, bytes | None, int]:
        """Write `value` iff `key`'s mod revision is `expected_revision` (None: iff absent).

        Returns (written, current value, current mod revision); the current value is None when the
        key does not exist.
        """

        def txn(c: MultiEndpointEtcd3Client) -> tuple[bool, list[Any]]:
            t = c.transactions
            compare = [t.version(key) == 0] if expected_revision is None else [t.mod(key) == expected_revision]
            # The get inside the same transaction returns the revision our write produced (or the
            # one that beat us), so the caller never needs a second, racy read.
            return c.transaction(compare=compare, success=[t.put(key, value), t.get(key)], failure=[t.get(key)])

        succeeded, responses = self.call(f"compare-and-swap {key}", txn)
        kvs = responses[-1]
        if not kvs:
            return bool(succeeded), None, 0
        current, meta = kvs[0]
        return bool(succeeded), bytes(current), int(meta.mod_revision)

    def delete_if_revision(self, key: str, revision: int) -> bool:
        """Delete `key` iff its mod revision is still `revision`; True when deleted."""

        def txn(c: MultiEndpointEtcd3Client) -> tuple[bool, list[Any]]:
            t = c.transactions
            return c.transaction(compare=[t.mod(key) == revision], success=[t.delete(key)], failure=[])

        succeeded, _ = self.call(f"conditional delete {key}", txn)
        return bool(succeeded)

    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer stored at `key` (absent: 0); return the new value."""
        while True:
            current = self.get(key)
            base = int(current[0]) if current is not None else 0
            written, _, _ = self.cas(key, str(base + amount).encode(), None if current is None else current[1])
            if written:
                return base + amount

    def lease_grant(self, ttl: int) -> int:
        """Grant a lease of `ttl` seconds; return its id."""
        return int(self.call("lease grant", lambda c: c.lease(ttl)).id)

    def lease_refresh(self, lease_id: int, tolerance: float | None = None) -> int:
        """Refresh a lease; return its remaining TTL (0 or less: the lease is gone)."""
        responses = self.call("lease keep-alive", lambda c: list(c.refresh_lease(lease_id)), tolerance)
        return int(responses[0].TTL) if responses else 0

    def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting the keys bound to it."""
        self.call("lease revoke", lambda c: c.revoke_lease(lease_id), tolerance=self.settings.request_timeout)

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
