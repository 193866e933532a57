"""Settings of the etcd v3 rendezvous: endpoint parsing and the `--rdzv-conf` keys, with their defaults."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from elastictrain.errors import RendezvousError

DEFAULT_PORT = 2379

# Every default lives here; docs/rendezvous.md lists the same table.
DEFAULTS: dict[str, Any] = {
    "key_prefix": "/elastictrain",
    "lease_ttl": 5,  # s; node record expires this long after its agent stops refreshing it
    "connect_timeout": 5.0,  # s; first contact: wrong endpoint/credentials/TLS fail within this
    "request_timeout": 5.0,  # s; one etcd RPC
    "outage_tolerance": 60.0,  # s; how long a running job rides out an unreachable etcd
    "last_call_timeout": 2,  # s; torch's default (30 s) mostly adds idle time after a node loss
    "rejoin_wait": 0,  # s; of a re-forming round's last call, kept for a lost node to come back
    "in_place_rejoin": 0,  # s; a lost node's place held for a new node to take over in place (0: a new round)
    "in_place_shrink": 0,  # 1: a lost node nobody replaces is dropped from the running round in place (shrink.py)
    "presence": 1,  # 1: agents hold idle TCP links to peers; a dead agent's lease is revoked at once (presence.py)
    "join_timeout": 600,  # s; torch's default
    "close_timeout": 30,  # s; torch's default
    "heartbeat_timeout": 5,  # s; torch's default
    "keep_alive_interval": 5,  # s; torch's state heartbeat, a fallback behind the etcd lease
    "keep_alive_max_attempt": 3,
}

_ENDPOINT_RE = re.compile(r"^(?:(?P<scheme>https?)://)?(?:\[(?P<ipv6>[^\]]+)\]|(?P<host>[^:/\[\]]+))(?::(?P<port>\d+))?/?$")


@dataclass(frozen=True)
class EtcdEndpoint:
    """One etcd member's client address."""

    host: str
    port: int = DEFAULT_PORT
    tls: bool = False

    @property
    def netloc(self) -> str:
        """`host:port` with IPv6 hosts bracketed, as gRPC expects."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.netloc}"


def parse_endpoints(spec: str) -> list[EtcdEndpoint]:
    """Parse `h1:2379,https://h2:2379,[::1]:2379` into endpoints (default port 2379)."""
    endpoints: list[EtcdEndpoint] = []
    for raw in (part.strip() for part in (spec or "").split(",")):
        if not raw:
            continue
        match = _ENDPOINT_RE.match(raw)
        if match is None:
            raise RendezvousError(
                f"invalid etcd endpoint {raw!r} in --rdzv-endpoint {spec!r}; expected HOST[:PORT], "
                "[IPV6][:PORT] or http(s)://HOST[:PORT], comma-separated for a cluster"
            )
        port = int(match["port"]) if match["port"] else DEFAULT_PORT
        if not 0 < port < 65536:
            raise RendezvousError(f"invalid port {port} in etcd endpoint {raw!r}")
        endpoints.append(EtcdEndpoint(match["ipv6"] or match["host"], port, match["scheme"] == "https"))
    if not endpoints:
        raise RendezvousError(
            "no etcd endpoint given: pass --rdzv-endpoint HOST:2379 (several separated by commas)"
        )
    return endpoints


def conf_seconds(conf: dict[str, Any], key: str, allow_zero: bool = False) -> float:
    """A `--rdzv-conf` number (seconds): positive, or >= 0 with `allow_zero`; its default when absent."""
    value = conf.get(key, DEFAULTS[key])
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RendezvousError(f"rdzv-conf {key}={value!r} is not a number") from None
    if not number >= 0 or (number == 0 and not allow_zero):  # NaN fails too
        raise RendezvousError(f"rdzv-conf {key}={value!r} must be {'>= 0' if allow_zero else 'positive'}")
    return number


def conf_flag(conf: dict[str, Any], key: str) -> bool:
    """A `--rdzv-conf` switch: 1/0, true/false, yes/no, on/off; its default when absent."""
    value = str(conf.get(key, DEFAULTS[key])).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise RendezvousError(f"rdzv-conf {key}={conf.get(key)!r} is not a switch; use 1 or 0")


@dataclass(frozen=True)
class EtcdSettings:
    """Everything needed to reach etcd and lay out one run's keys."""

    endpoints: list[EtcdEndpoint]
    run_id: str
    key_prefix: str = DEFAULTS["key_prefix"]
    lease_ttl: int = DEFAULTS["lease_ttl"]
    connect_timeout: float = DEFAULTS["connect_timeout"]
    request_timeout: float = DEFAULTS["request_timeout"]
    outage_tolerance: float = DEFAULTS["outage_tolerance"]
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        """True when any endpoint says https or a CA is given."""
        return self.cacert is not None or any(ep.tls for ep in self.endpoints)

    @property
    def run_prefix(self) -> str:
        """`/elastictrain/<run_id>`: every key of this run lives below it."""
        return f"{self.key_prefix.rstrip('/')}/{self.run_id}"

    def endpoints_str(self) -> str:
        """The endpoints as one string for error messages."""
        return ",".join(str(ep) for ep in self.endpoints)

    @classmethod
    def from_conf(cls, endpoint: str, run_id: str, conf: dict[str, Any]) -> EtcdSettings:
        """Build settings from `--rdzv-endpoint`, `--rdzv-id` and the `--rdzv-conf` dict."""
        if not run_id or "/" in run_id:
            raise RendezvousError(f"invalid --rdzv-id {run_id!r}: it must be non-empty and contain no '/'")
        ttl = conf_seconds(conf, "lease_ttl")
        if ttl < 2:
            # etcd refuses (rounds up) TTLs under its election-derived minimum of ~2 s.
            raise RendezvousError(f"rdzv-conf lease_ttl={ttl:g} is too short: etcd needs at least 2 s")
        user, password = conf.get("user"), conf.get("password")
        if (user is None) != (password is None):
            raise RendezvousError("rdzv-conf needs both user and password for etcd authentication, or neither")
        cert, key = conf.get("cert"), conf.get("key")
        if (cert is None) != (key is None):
            raise RendezvousError("rdzv-conf needs both cert and key for a TLS client certificate, or neither")
        settings = cls(
            endpoints=parse_endpoints(endpoint),
            run_id=run_id,
            key_prefix=str(conf.get("key_prefix", DEFAULTS["key_prefix"])),
            lease_ttl=int(round(ttl)),
            connect_timeout=conf_seconds(conf, "connect_timeout"),
            request_timeout=conf_seconds(conf, "request_timeout"),
            outage_tolerance=conf_seconds(conf, "outage_tolerance"),
            cacert=conf.get("cacert"),
            cert=cert,
            key=key,
            user=None if user is None else str(user),
            password=None if password is None else str(password),
        )
        if settings.tls and settings.cacert is None:
            raise RendezvousError(
                f"https endpoint in {settings.endpoints_str()} but no CA: pass --rdzv-conf cacert=/path/ca.pem"
            )
        return settings
