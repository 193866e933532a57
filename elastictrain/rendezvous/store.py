"""EtcdStore: a c10d Store on etcd v3, so that no agent hosts a store the others depend on."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from elastictrain.rendezvous.client import EtcdClient

logger = logging.getLogger(__name__)

# Waiting polls etcd with a growing interval: short waits (the usual case inside a rendezvous) are
# answered within milliseconds, long waits cost at most 10 reads a second per waiter.
_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.1
_ABANDON_CHECK_S = 1.0
"""How often a blocked `get`/`wait` asks `EtcdStore.abandoned` whether to give up."""


def _to_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """The c10d Store operations torch's elastic agent uses (set/get/add/wait/compare_set/...).

    Keys live under `prefix`; values are raw bytes. `get` and `wait` block until the keys exist or
    the store's timeout passes (then raise `DistStoreError`, a RuntimeError, as TCPStore does). Every
    write takes effect once even when etcd's reply is lost and the client retries (see EtcdClient).
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix.rstrip("/") + "/"
        self.set_timeout(timeout)
        self.abandoned: Optional[Callable[[], Optional[str]]] = None
        """Asked about once a second while `get`/`wait` block: a reason ends the wait at once (DistStoreError)
        instead of at the timeout. The rendezvous handler sets it: keys of a round every member has left never come."""

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        """Write `key`."""
        self._client.put(self._key(key), _to_bytes(value))

    def get(self, key: str) -> bytes:
        """Return `key`'s value, waiting for it to appear."""
        return self._wait_get([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Return the values of `keys`, waiting for all of them."""
        return self._wait_get(list(keys), None)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Write several keys."""
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the integer at `key` atomically; return the new value."""
        return self._client.add(self._key(key), int(amount))

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Set `key` to `desired_value` iff it holds `expected_value` (empty: iff absent); return the value now."""
        expected, desired = _to_bytes(expected_value), _to_bytes(desired_value)
        full = self._key(key)
        while True:
            current = self._client.get(full)
            if current is None:
                if expected:
                    # TCPStore's convention: a missing key with a non-empty expectation returns it.
                    return expected
                written, value, _ = self._client.cas(full, desired, None)
            elif current[0] == expected:
                written, value, _ = self._client.cas(full, desired, current[1])
            else:
                return current[0]
            if written:
                return desired
            if value is not None and value != expected:
                return value

    def check(self, keys: list[str]) -> bool:
        """True when every key exists."""
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists."""
        self._wait_get(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        """Delete `key`; True when it existed."""
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        """How many keys this store holds."""
        return self._client.count_prefix(self._prefix)

    def _wait_get(self, keys: list[str], timeout: timedelta | None) -> list[bytes]:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        values: dict[str, bytes] = {}
        interval = _POLL_MIN_S
        check_at = time.monotonic() + _ABANDON_CHECK_S
        while True:
            for key in keys:
                if key not in values:
                    found = self._client.get(self._key(key))
                    if found is not None:
                        values[key] = found[0]
            if len(values) == len(keys):
                return [values[k] for k in keys]
            now = time.monotonic()
            if now >= deadline:
                missing = [k for k in keys if k not in values]
                raise dist.DistStoreError(
                    f"etcd store: keys {missing} under {self._prefix} not set within {limit:g} s"
                )
            if self.abandoned is not None and now >= check_at:
                check_at = now + _ABANDON_CHECK_S
                reason = self.abandoned()
                if reason:
                    missing = [k for k in keys if k not in values]
                    raise dist.DistStoreError(f"etcd store: stopped waiting for keys {missing} under {self._prefix}: "
                                              f"{reason}")
            time.sleep(interval)
            interval = min(interval * 2, _POLL_MAX_S)
