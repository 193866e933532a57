"""The etcd3 rendezvous handler in-process: group formation, lost nodes, etcd outages, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastictrain.errors import RendezvousError
from elastictrain.rendezvous.embedded import EmbeddedEtcd, free_port
from elastictrain.rendezvous.etcd_handler import EtcdRendezvousHandler, create_etcd_handler
from tests.fixtures.etcd import EtcdHandle


def _params(endpoint: str, run_id: str, min_nodes: int = 1, max_nodes: int = 3, **conf: object) -> RendezvousParameters:
    conf.setdefault("last_call_timeout", 1)
    conf.setdefault("lease_ttl", 2)
    return RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, **conf)


def _rendezvous_all(handlers: list[EtcdRendezvousHandler]) -> list:
    infos: list = [None] * len(handlers)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return infos


def _kill_without_goodbye(handler: EtcdRendezvousHandler) -> None:
    """What SIGKILL does to a node: its lease and its torch heartbeats stop, nobody says goodbye."""
    handler._stop_heartbeats()
    handler.liveness._stop.set()


def test_three_agents_form_one_group_and_share_bootstrap_info(etcd: EtcdHandle, run_id: str) -> None:
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, 3, 3)) for _ in range(3)]
    infos = _rendezvous_all(handlers)
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    boot = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(boot) == 1
    # Workers must host their own process-group store, never an agent's.
    assert not any(h.use_agent_store for h in handlers)
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    # The store handed to the agent is the etcd store: a key set by one is seen by all.
    infos[0].store.set("hello", "world")
    assert infos[2].store.get("hello") == b"world"
    for h in handlers:
        h.shutdown()


def test_survivors_see_a_lost_node_and_form_a_smaller_round(etcd: EtcdHandle, run_id: str) -> None:
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3)) for _ in range(3)]
    infos = _rendezvous_all(handlers)
    first = next(h for h, i in zip(handlers, infos, strict=True) if i.rank == 0)
    survivors = [h for h in handlers if h is not first]
    _kill_without_goodbye(first)  # the node that held rank 0, i.e. the "first" node

    start = time.monotonic()
    while survivors[0].num_nodes_waiting() == 0:
        assert time.monotonic() - start < 8, "lost node not noticed"
        time.sleep(0.1)
    noticed = time.monotonic() - start
    assert noticed < 2 + 2 + 1  # lease ttl + the keep-alive period it had left + slack

    infos = _rendezvous_all(survivors)
    assert sorted(i.rank for i in infos) == [0, 1]
    assert {i.world_size for i in infos} == {2}
    assert time.monotonic() - start < 12
    for h in survivors:
        h.shutdown()


def _lose_rank0(handlers: list[EtcdRendezvousHandler]) -> list[EtcdRendezvousHandler]:
    infos = _rendezvous_all(handlers)
    first = next(h for h, i in zip(handlers, infos, strict=True) if i.rank == 0)
    _kill_without_goodbye(first)
    return [h for h in handlers if h is not first]


def test_survivors_reform_without_waiting_out_the_last_call_for_a_dead_node(etcd: EtcdHandle, run_id: str) -> None:
    # A 30 s last call (torch's default): torch would idle survivors that long after every node loss.
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, last_call_timeout=30)) for _ in range(3)]
    survivors = _lose_rank0(handlers)
    start = time.monotonic()
    infos = _rendezvous_all(survivors)
    assert {i.world_size for i in infos} == {2}
    # lease ttl 2 s (+ the keep-alive period it had left) and a round; far below the 30 s last call
    assert time.monotonic() - start < 15
    for h in survivors:
        h.shutdown()


def test_the_rejoin_wait_lets_a_lost_node_that_comes_back_into_the_same_round(etcd: EtcdHandle, run_id: str) -> None:
    conf = {"last_call_timeout": 60, "rejoin_wait": 20}
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, **conf)) for _ in range(3)]
    survivors = _lose_rank0(handlers)
    results: list = []
    thread = threading.Thread(target=lambda: results.append(_rendezvous_all(survivors)), daemon=True)
    thread.start()
    while survivors[0]._state_holder.state.round == 0:  # the lost node's lease expired: a new round opened
        assert thread.is_alive()
        time.sleep(0.1)
    time.sleep(1.0)
    returned = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, **conf))  # the node, started again
    joined: list = []
    joiner = threading.Thread(target=lambda: joined.append(returned.next_rendezvous()), daemon=True)
    joiner.start()
    joiner.join(timeout=30)
    thread.join(timeout=30)
    # without the wait the survivors would have formed a round of 2 and left it waiting for the next one
    assert joined and joined[0].world_size == 3 and {i.world_size for i in results[0]} == {3}
    for h in [*survivors, returned]:
        h.shutdown()


def test_a_live_node_slow_to_rejoin_is_waited_for(etcd: EtcdHandle, run_id: str) -> None:
    # A worker failure: every agent is alive and re-joins, one of them late; nobody is left behind.
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3, last_call_timeout=30)) for _ in range(3)]
    _rendezvous_all(handlers)
    results: list = []
    thread = threading.Thread(target=lambda: results.append(_rendezvous_all(handlers[:2])))
    thread.start()
    time.sleep(3.0)
    late = handlers[2].next_rendezvous()
    thread.join(timeout=60)
    assert late.world_size == 3 and {i.world_size for i in results[0]} == {3}
    for h in handlers:
        h.shutdown()


def test_a_node_that_comes_back_is_waiting_and_joins_a_bigger_round(etcd: EtcdHandle, run_id: str) -> None:
    handlers = [create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3)) for _ in range(2)]
    _rendezvous_all(handlers)
    newcomer = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 3))
    joined: list = []
    thread = threading.Thread(target=lambda: joined.append(newcomer.next_rendezvous()))
    thread.start()
    start = time.monotonic()
    while handlers[0].num_nodes_waiting() == 0:
        assert time.monotonic() - start < 10
        time.sleep(0.1)
    infos = _rendezvous_all(handlers)  # what torch's agent does when nodes are waiting
    thread.join(timeout=30)
    assert {i.world_size for i in [*infos, *joined]} == {3}
    for h in [*handlers, newcomer]:
        h.shutdown()


def test_etcd_outage_of_a_few_seconds_is_ridden_out(etcd_private: EtcdHandle, run_id: str) -> None:
    handlers = [create_etcd_handler(_params(etcd_private.endpoint, run_id, 2, 2)) for _ in range(2)]
    _rendezvous_all(handlers)
    etcd_private.stop()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        call_start = time.monotonic()
        assert handlers[0].num_nodes_waiting() == 0  # no exception, no restart
        assert time.monotonic() - call_start < 3.5  # the monitor loop is never blocked long
        time.sleep(0.2)
    etcd_private.restart()
    time.sleep(2.5)  # > a keep-alive period: leases must have been refreshed, none expired
    assert handlers[0].num_nodes_waiting() == 0
    assert handlers[1].num_nodes_waiting() == 0
    time.sleep(1.1)
    handlers[0].num_nodes_waiting()
    # The watches broken by the restart are back (no silent fallback to polling).
    assert not handlers[0]._state_holder._watch_broken
    assert not handlers[0].liveness._watch_broken.is_set()
    for h in handlers:
        h.shutdown()


def test_a_finished_run_id_can_be_reused(etcd: EtcdHandle, run_id: str) -> None:
    handler = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 1))
    handler.next_rendezvous()
    # The old job's in-place records are keyed by round; the new job numbers its rounds from 0 again.
    old = f"{handler._client.settings.run_prefix}/inplace/finished/{handler.round_number}"
    handler._client.put(old, b"3")
    handler.set_closed()
    handler.shutdown()
    again = create_etcd_handler(_params(etcd.endpoint, run_id, 1, 1))
    assert again.next_rendezvous().world_size == 1
    assert again._client.get(old) is None, "an earlier job's in-place record would be read as the new job's"
    again.shutdown()


def test_wrong_endpoint_fails_within_seconds_naming_it(run_id: str) -> None:
    port = free_port("127.0.0.1")
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}"):
        create_etcd_handler(_params(f"127.0.0.1:{port}", run_id, connect_timeout=2))
    assert time.monotonic() - start < 5


def test_failover_to_a_live_endpoint_of_the_list(make_client, etcd: EtcdHandle, run_id: str) -> None:
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"
    # The client starts on a random member: several clients make it near certain one starts on the dead one. A short
    # connect_timeout: the client must move to the live member after one failed probe, not retry the list at random.
    for i in range(12):
        client = make_client(f"{dead},{etcd.endpoint}", run_id, connect_timeout=1)
        client.put(f"/elastictrain/{run_id}/k{i}", b"v")
        assert client.get(f"/elastictrain/{run_id}/k{i}")[0] == b"v"
    handler = create_etcd_handler(_params(f"{dead},{etcd.endpoint}", run_id, 1, 1))
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()


def _etcdctl(endpoint: str, *args: str) -> None:
    etcdctl = str(Path(sys.executable).parent / "etcdctl")
    subprocess.run([etcdctl, f"--endpoints={endpoint}", *args], check=True, capture_output=True, timeout=20)


def test_user_password_auth_works_and_wrong_credentials_fail_fast(etcd_private: EtcdHandle, run_id: str) -> None:
    _etcdctl(etcd_private.endpoint, "user", "add", "root:rootpw")
    _etcdctl(etcd_private.endpoint, "auth", "enable")
    handler = create_etcd_handler(_params(etcd_private.endpoint, run_id, 1, 1, user="root", password="rootpw"))
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()

    start = time.monotonic()
    with pytest.raises(RendezvousError, match=f"{etcd_private.endpoint}.*(authentication|user)"):
        create_etcd_handler(_params(etcd_private.endpoint, run_id, user="root", password="wrong"))
    with pytest.raises(RendezvousError, match=f"{etcd_private.endpoint}.*(authentication|user name)"):
        create_etcd_handler(_params(etcd_private.endpoint, run_id))
    assert time.monotonic() - start < 5


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1, a client certificate and an unrelated CA."""
    d = tmp_path_factory.mktemp("tls")

    def sh(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d, timeout=60)

    for ca in ("ca", "other-ca"):
        sh("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={ca}",
           "-keyout", f"{ca}.key", "-out", f"{ca}.pem")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        sh("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
           "-out", f"{name}.csr")
        sh("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
           "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem")  # fmt: skip
    return {k: str(d / k) for k in ("ca.pem", "other-ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_tls_with_client_certificates_works_and_mismatches_fail_fast(tls_files: dict[str, str], run_id: str) -> None:
    with EmbeddedEtcd(tls_cert=tls_files["server.pem"], tls_key=tls_files["server.key"],
                      tls_ca=tls_files["ca.pem"]) as srv:
        tls = {"cacert": tls_files["ca.pem"], "cert": tls_files["client.pem"], "key": tls_files["client.key"]}
        handler = create_etcd_handler(_params(f"https://{srv.endpoint}", run_id, 1, 1, **tls))
        assert handler.next_rendezvous().world_size == 1
        handler.shutdown()

        start = time.monotonic()
        with pytest.raises(RendezvousError, match=f"{srv.endpoint}.*TLS"):
            create_etcd_handler(_params(srv.endpoint, run_id, connect_timeout=2))  # plain client, TLS server
        wrong_ca = {**tls, "cacert": tls_files["other-ca.pem"]}
        with pytest.raises(RendezvousError, match=f"{srv.endpoint}.*TLS"):
            create_etcd_handler(_params(f"https://{srv.endpoint}", run_id, connect_timeout=2, **wrong_ca))
        assert time.monotonic() - start < 10


def test_a_wait_on_the_keys_of_a_round_every_member_left_ends_at_once(etcd: EtcdHandle, run_id: str) -> None:
    """Seen in the netns chaos run: a node cut off while a round formed waited the store's whole 60 s for its ranks
    (torch's group-rank-0 agent writes them) after every other member had left that round, while they waited for it
    in the next. Once the rendezvous is at a newer round, such a wait ends within about a second, saying why, and the
    agent's round set-up retry joins the new round."""
    a, b = (create_etcd_handler(_params(etcd.endpoint, run_id, 1, 2)) for _ in range(2))
    _rendezvous_all([a, b])
    assert b._round_over() is None, "a running round is not over"
    first = b._round[0]
    _kill_without_goodbye(b)  # b is cut off: its lease lapses and the survivor ...
    joined = threading.Thread(target=a.next_rendezvous, daemon=True)  # ... leaves round 1 for a new one
    joined.start()
    start = time.monotonic()
    while a._state_holder.state.round <= first:
        assert time.monotonic() - start < 20, "the survivor never started a new round"
        time.sleep(0.1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rendezvous round {first} is over"):
        b._store.get("assigned_ranks_of_the_old_round")  # what b's agent waits for after that round
    assert time.monotonic() - start < 5, "the wait should end at the next check, not at the store's 60 s timeout"
    joined.join(timeout=30)
    a.shutdown()
