"""Transport faults for EtcdClient tests: a request that etcd applies but whose reply never arrives.

A gRPC client interceptor on the client's channels lets the request reach etcd, waits for etcd to
apply it, and then raises the error a lost reply raises (DEADLINE_EXCEEDED or UNAVAILABLE), so the
client goes through pyetcd's error mapping and its own retry exactly as after a real network fault.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import grpc

from elastictrain.rendezvous.client import EtcdClient


class _LostReplyError(grpc.RpcError):
    """What the gRPC runtime raises when a call's reply does not arrive."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "injected: etcd applied the request, its reply was lost"

    def result(self, timeout: float | None = None) -> Any:
        raise self


class EtcdTransport(grpc.UnaryUnaryClientInterceptor):
    """Counts the unary RPCs of a client by method and drops the replies of chosen ones after they commit."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()
        self._to_lose: dict[str, list[grpc.StatusCode]] = {}
        self._lock = threading.Lock()

    def lose_next(self, method: str, code: grpc.StatusCode = grpc.StatusCode.DEADLINE_EXCEEDED,
                  times: int = 1) -> None:  # fmt: skip
        """The next `times` calls of `method` (e.g. "Txn", "Put", "LeaseRevoke") reach etcd but fail with `code`."""
        with self._lock:
            self._to_lose.setdefault(method, []).extend([code] * times)

    def reset_counts(self) -> None:
        """Forget the calls counted so far."""
        with self._lock:
            self.calls.clear()

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        name = method.rsplit("/", 1)[-1]
        outcome = continuation(details, request)
        with self._lock:
            self.calls[name] += 1
            pending = self._to_lose.get(name)
            code = pending.pop(0) if pending else None
        if code is None:
            return outcome
        outcome.result()  # the reply arrived, so etcd has applied the request; now lose it
        with self._lock:
            self.lost[name] += 1
        return _LostReplyError(code)


def intercept(client: EtcdClient) -> EtcdTransport:
    """Route `client`'s unary RPCs through a new EtcdTransport (for this connection; call after connect)."""
    transport = EtcdTransport()
    raw = client._raw()
    for endpoint in raw.endpoints.values():
        endpoint.channel = grpc.intercept_channel(endpoint.channel, transport)
    raw._clear_old_stubs()  # stubs are cached per channel
    return transport
