"""EtcdV3Backend: torch's RendezvousBackend on one etcd v3 key, compare-and-swap on its mod revision."""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastictrain.rendezvous.client import EtcdClient

logger = logging.getLogger(__name__)


class EtcdV3Backend(RendezvousBackend):
    """Hold the rendezvous state at `<run_prefix>/rdzv`; the fencing token is the key's mod revision.

    etcd assigns a new, cluster-wide increasing revision to every write, so a token read by one agent
    is stale as soon as any other agent writes: exactly the fencing torch's state holder expects.
    """

    def __init__(self, client: EtcdClient, key: str) -> None:
        self._client = client
        self._key = key

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd3"

    @property
    def key(self) -> str:
        """The etcd key holding the state."""
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        return self._client.get(self._key)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class: write iff `token` is the current revision (None: iff no state exists yet)."""
        if token is not None and not isinstance(token, int):
            # A token we never handed out cannot match; report the current state without writing.
            current = self.get_state()
            return None if current is None else (current[0], current[1], False)
        written, value, revision = self._client.cas(self._key, state, token)
        if value is None:
            return None
        return value, revision, written
