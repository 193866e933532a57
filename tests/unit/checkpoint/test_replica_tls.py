"""Peer replicas over mutual TLS (elastic.replica_tls): a replica travels and commits between two TLS nodes, and
everything else is refused with the setting named: a node without TLS, a client certificate from another CA, a
server certificate that does not name the server's address, a config that gives only part of the files or a key
that is not the certificate's.

The certificates are made here with the `openssl` command (a CA, node certificates naming 127.0.0.1 or another
address, a second CA): without it these tests skip, saying so, and CI (which installs it) requires them to run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from elastictrain.checkpoint.replica_server import ReplicaServer
from elastictrain.checkpoint.replica_tls import ReplicaTLS
from elastictrain.checkpoint.replica_wire import PeerList, SlotReader, committed_markers, fetch, held, push
from elastictrain.checkpoint.snapshot import SnapshotStore
from elastictrain.config import config_from_dict
from elastictrain.errors import ConfigError, SnapshotReplicaError
from tests.fixtures.pki import make_pki, needs_openssl

JOB = {"run_id": "r", "fingerprint": "f", "world_size": 2}
pytestmark = needs_openssl


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: Path, name: str, ca: str = "ca", check_hostname: bool = True) -> ReplicaTLS:
    return ReplicaTLS(str(pki / f"{name}.pem"), str(pki / f"{name}.key"), str(pki / f"{ca}.pem"), check_hostname)


def _slot(tmp_path: Path) -> SlotReader:
    store = SnapshotStore(tmp_path / "a", 0, JOB)
    info = store.save(7, {"w": torch.arange(1000, dtype=torch.float32)})
    reader = SlotReader.open(store.dir, info.slot)
    assert reader is not None
    return reader


def _server(tmp_path: Path, tls) -> ReplicaServer:
    return ReplicaServer(tmp_path / "b", "127.0.0.1", "node-b", "token-b", tls)


def test_a_replica_travels_and_commits_between_two_tls_nodes_and_is_fetched_back(tmp_path, pki):
    server = _server(tmp_path, _tls(pki, "node-b"))
    try:
        peer = replace(server.peer(), client_tls=_tls(pki, "node-a"))
        assert peer.tls and peer.record()["tls"] is True and "client_tls" not in peer.record()
        reader = _slot(tmp_path)
        assert push(peer, "node-a", 0, reader, 10) == reader.marker["checksum"]
        [(path, marker)] = [(p, m) for p, m in held(peer, 0, 5) if p.startswith("replicas/")]
        assert marker["step"] == 7
        got = fetch(peer, path, marker["slot"], tmp_path / "c" / "rank0", 0, 5)
        assert got["checksum"] == reader.marker["checksum"]
        assert [m["step"] for m in committed_markers(tmp_path / "c" / "rank0")] == [7]
    finally:
        server.close()


def test_a_node_without_tls_and_a_node_with_it_do_not_talk_and_say_which_setting(tmp_path, pki):
    tls_server = _server(tmp_path / "1", _tls(pki, "node-b"))
    plain_server = _server(tmp_path / "2", None)
    try:
        reader = _slot(tmp_path)
        with pytest.raises(SnapshotReplicaError, match="over TLS and this node has no elastic.replica_tls"):
            push(replace(tls_server.peer(), client_tls=None), "node-a", 0, reader, 5)
        with pytest.raises(SnapshotReplicaError, match="without TLS and this node requires it"):
            push(replace(plain_server.peer(), client_tls=_tls(pki, "node-a")), "node-a", 0, reader, 5)
        # A plain HTTP request that reaches the TLS port anyway (an old agent): no answer, nothing committed.
        with pytest.raises(SnapshotReplicaError):
            held(replace(tls_server.peer(), tls=False, client_tls=None), 0, 5)
        assert not (tls_server.folder / "replicas").exists()
    finally:
        tls_server.close()
        plain_server.close()


def test_a_client_certificate_from_another_ca_is_refused(tmp_path, pki):
    server = _server(tmp_path, _tls(pki, "node-b"))
    try:
        intruder = replace(server.peer(), client_tls=_tls(pki, "intruder", ca="ca"))
        with pytest.raises(SnapshotReplicaError):
            push(intruder, "node-a", 0, _slot(tmp_path), 5)
        assert not (server.folder / "replicas").exists()
    finally:
        server.close()


def test_a_server_certificate_must_name_the_servers_address_unless_check_hostname_is_off(tmp_path, pki):
    server = _server(tmp_path, _tls(pki, "elsewhere"))  # its certificate names 127.0.0.2, it listens on 127.0.0.1
    try:
        with pytest.raises(SnapshotReplicaError, match="(?i)mismatch|doesn't match|not valid for"):
            held(replace(server.peer(), client_tls=_tls(pki, "node-a")), 0, 5)
        relaxed = replace(server.peer(), client_tls=_tls(pki, "node-a", check_hostname=False))
        assert held(relaxed, 0, 5) == []  # the chain is still checked: any holder of the job CA's certificate
    finally:
        server.close()


def test_the_workers_peer_list_carries_the_nodes_tls_files(tmp_path, pki):
    tls = _tls(pki, "node-a")
    server = _server(tmp_path, _tls(pki, "node-b"))
    try:
        PeerList("node-a", [server.peer()], tls).write(tmp_path)
        read = PeerList.read(tmp_path)
        assert read is not None and read.tls == tls and read.peers[0].client_tls == tls
        assert held(read.peers[0], 0, 5) == []  # a restarting worker reaches the TLS server with the node's files
    finally:
        server.close()


def test_a_partial_tls_setting_is_a_config_error_naming_what_is_missing(pki):
    with pytest.raises(ConfigError, match="needs cert, key and ca together \\(missing: key, ca\\)"):
        config_from_dict({"elastic": {"replica_tls": {"cert": str(pki / "node-a.pem")}}})
    # The files are the agent's to read at its start: a config read elsewhere (an operator's) need not hold them.
    config_from_dict({"elastic": {"replica_tls": {k: f"/elsewhere/{k}.pem" for k in ("cert", "key", "ca")}}})


def test_a_missing_file_or_a_key_that_is_not_the_certificates_is_refused_at_start_up(pki):
    wrong = ReplicaTLS(str(pki / "node-a.pem"), str(pki / "node-b.key"), str(pki / "ca.pem"))
    with pytest.raises(ConfigError, match="replica_tls.cert=.*node-a.pem / key=.*node-b.key"):
        wrong.check()
    not_pem = ReplicaTLS(str(pki / "node-a.pem"), str(pki / "node-a.key"), str(pki / "node-a.ext"))
    with pytest.raises(ConfigError, match="replica_tls.ca=.*not a readable PEM CA certificate"):
        not_pem.check()
    missing = ReplicaTLS(str(pki / "node-a.pem"), str(pki / "node-a.key"), str(pki / "missing.pem"))
    with pytest.raises(ConfigError, match="replica_tls.ca=.*missing.pem: not a readable .*No such file"):
        missing.check()
    _tls(pki, "node-a").check()
