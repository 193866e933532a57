"""Endpoint parsing and `--rdzv-conf` validation (no etcd needed)."""

from __future__ import annotations

import pytest

from elastictrain.errors import RendezvousError
from elastictrain.rendezvous.settings import DEFAULTS, EtcdEndpoint, EtcdSettings, parse_endpoints


def test_parse_endpoints_accepts_cluster_lists_schemes_ipv6_and_default_port() -> None:
    eps = parse_endpoints("h1:2379, https://h2:3000,[::1]:4000,h4,http://10.0.0.5")
    assert eps == [
        EtcdEndpoint("h1", 2379),
        EtcdEndpoint("h2", 3000, tls=True),
        EtcdEndpoint("::1", 4000),
        EtcdEndpoint("h4", 2379),
        EtcdEndpoint("10.0.0.5", 2379),
    ]
    assert eps[2].netloc == "[::1]:4000"
    assert str(eps[1]) == "https://h2:3000"


@pytest.mark.parametrize("spec", ["", " , ", "h1:notaport", "h1:99999", "ftp://h1:2379", "h1:2379/path"])
def test_parse_endpoints_rejects_malformed_input_naming_it(spec: str) -> None:
    with pytest.raises(RendezvousError, match="endpoint|port"):
        parse_endpoints(spec)


def test_settings_defaults_and_run_prefix() -> None:
    s = EtcdSettings.from_conf("127.0.0.1:2379", "job1", {})
    assert s.lease_ttl == DEFAULTS["lease_ttl"]
    assert s.outage_tolerance == DEFAULTS["outage_tolerance"]
    assert s.run_prefix == "/elastictrain/job1"
    assert not s.tls


def test_settings_read_tls_auth_and_timeouts_from_rdzv_conf() -> None:
    conf = {
        "cacert": "/ca.pem", "cert": "/c.pem", "key": "/k.pem", "user": "u", "password": "s3cret",
        "lease_ttl": "3", "connect_timeout": "1.5", "key_prefix": "/jobs",
    }  # fmt: skip
    s = EtcdSettings.from_conf("etcd-a:2379,etcd-b:2379", "r", conf)
    assert s.tls and s.cacert == "/ca.pem" and (s.cert, s.key) == ("/c.pem", "/k.pem")
    assert (s.user, s.password) == ("u", "s3cret")
    assert s.lease_ttl == 3 and s.connect_timeout == 1.5
    assert s.run_prefix == "/jobs/r"
    assert "s3cret" not in repr(s)  # the password never shows in logs


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"user": "u"}, "user and password"),
        ({"cert": "/c.pem"}, "cert and key"),
        ({"lease_ttl": "1"}, "at least 2"),
        ({"lease_ttl": "abc"}, "not a number"),
        ({"connect_timeout": "-1"}, "positive"),
    ],
)
def test_settings_reject_inconsistent_conf(conf: dict[str, str], match: str) -> None:
    with pytest.raises(RendezvousError, match=match):
        EtcdSettings.from_conf("h:2379", "r", conf)


def test_https_endpoint_without_ca_is_refused() -> None:
    with pytest.raises(RendezvousError, match="cacert"):
        EtcdSettings.from_conf("https://h:2379", "r", {})


@pytest.mark.parametrize("run_id", ["", "a/b"])
def test_run_id_must_be_a_single_path_segment(run_id: str) -> None:
    with pytest.raises(RendezvousError, match="rdzv-id"):
        EtcdSettings.from_conf("h:2379", run_id, {})


def test_rendezvous_timeouts_take_fractions_and_bad_values_name_the_key() -> None:
    from elastictrain.rendezvous.settings import conf_seconds

    conf = {"last_call_timeout": "0.5", "rejoin_wait": "0"}
    assert conf_seconds(conf, "last_call_timeout") == 0.5
    assert conf_seconds(conf, "rejoin_wait", allow_zero=True) == 0.0
    assert conf_seconds({}, "rejoin_wait", allow_zero=True) == DEFAULTS["rejoin_wait"]
    for key, value, allow_zero in (("last_call_timeout", "0", False), ("rejoin_wait", "-1", True),
                                   ("rejoin_wait", "soon", True), ("rejoin_wait", "nan", True)):
        with pytest.raises(RendezvousError, match=f"rdzv-conf {key}="):
            conf_seconds({key: value}, key, allow_zero=allow_zero)
