"""TLS for the peer replicas of in-memory snapshots (`elastic.replica_tls`): the agents' replica servers and every
client of theirs (a sending agent, a restarting worker fetching its rank's snapshot) speak HTTPS, mutually
authenticated against the job's CA.

Mutual: every agent both serves and connects, so each node needs a certificate and key (`cert`, `key`, PEM) issued
by the CA (`ca`, PEM) that every node trusts. A server requires a client certificate from that CA; a client verifies
the server's against it and, with `check_hostname` (the default), that the certificate names the address the server
published (its `--local-addr`, or the host name's address: give each node's certificate that IP address or DNS
name as a subjectAltName). A job-wide certificate without per-node names needs `check_hostname: false`: any holder
of a certificate from the job's CA is then trusted, as the per-node token is today.

The per-request token stays: TLS keeps the state (model weights, optimizer moments) private on the wire and proves
who is at the other end; the token ties a request to the job's etcd. A node without TLS and one with it do not talk:
the first replica fails, once, naming the setting to align.
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import asdict, dataclass
from typing import Any, Optional

from elastictrain.config import ReplicaTLSConfig
from elastictrain.errors import ConfigError


@dataclass(frozen=True)
class ReplicaTLS:
    """The node's TLS files (paths on this node) and whether a server's certificate must name its address."""

    cert: str
    key: str
    ca: str
    check_hostname: bool = True

    @classmethod
    def from_config(cls, c: ReplicaTLSConfig) -> Optional["ReplicaTLS"]:
        """None without `elastic.replica_tls` (plain HTTP); the config's checks have run (cert, key, ca together)."""
        if c.cert is None or c.key is None or c.ca is None:
            return None
        return cls(c.cert, c.key, c.ca, c.check_hostname)

    @classmethod
    def from_dict(cls, raw: Any) -> Optional["ReplicaTLS"]:
        """From `peers.json` (`to_dict`); None for a missing or malformed entry."""
        try:
            return cls(**raw) if raw else None
        except TypeError:
            return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def server_context(self) -> ssl.SSLContext:
        return _context(self, server=True)

    def client_context(self) -> ssl.SSLContext:
        return _context(self, server=False)

    def check(self) -> None:
        """Load both contexts now: ConfigError naming the setting when a file is missing, not PEM, or the key does
        not match the certificate (at start-up, not at the first replica)."""
        self.server_context()
        self.client_context()


@functools.lru_cache(maxsize=8)
def _context(tls: ReplicaTLS, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=tls.ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"elastic.replica_tls.ca={tls.ca}: not a readable PEM CA certificate ({e}); give the CA "
                          f"that issued every node's replica certificate") from None
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"elastic.replica_tls.cert={tls.cert} / key={tls.key}: not a readable PEM certificate and "
                          f"its private key ({e}); give this node's certificate and the key it was issued for") \
            from None
    ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: a server asks for the client's certificate too
    if not server:
        ctx.check_hostname = tls.check_hostname
    return ctx


__all__ = ["ReplicaTLS"]
