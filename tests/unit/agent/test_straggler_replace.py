"""The straggler replacement policy (elastictrain/agent/straggler_replace.py): restart first, drain a host that
straggles again, never below min_nodes; and its records round-trip through their JSON."""

from elastictrain.agent.straggler_replace import HostRecord, ReplacePolicy, ReplaceRequest, choose_action

NOW = 1_000_000.0


def test_a_host_is_restarted_first_and_drained_when_it_straggles_again_within_the_window():
    policy = ReplacePolicy(drain_window_s=600, min_nodes=1)
    assert choose_action(HostRecord(), NOW, nodes=2, policy=policy)[0] == "restart"
    again = HostRecord(restarts=[NOW - 300])
    action, why = choose_action(again, NOW, nodes=2, policy=policy)
    assert action == "drain" and "straggler_drain_window_s=600s" in why
    assert choose_action(HostRecord(restarts=[NOW - 900]), NOW, nodes=2, policy=policy)[0] == "restart", \
        "a restart longer ago than the window is forgotten"
    assert choose_action(HostRecord(drained=[NOW - 60]), NOW, nodes=2, policy=policy)[0] == "drain", \
        "a host drained lately that came back and straggles is drained at once"


def test_a_drain_below_min_nodes_is_refused_with_the_reason():
    action, why = choose_action(HostRecord(restarts=[NOW - 10]), NOW, nodes=2, policy=ReplacePolicy(600, min_nodes=2))
    assert action == "keep" and "below min_nodes=2" in why and "leave 1 node(s)" in why


def test_a_zero_window_never_drains():
    policy = ReplacePolicy(drain_window_s=0, min_nodes=1)
    assert choose_action(HostRecord(restarts=[NOW - 1, NOW - 2]), NOW, nodes=4, policy=policy)[0] == "restart"


def test_records_round_trip():
    req = ReplaceRequest(seq=5, slow_rank=3, round=2, step=40, lateness_s=0.15, score=0.6, by="n0", time=NOW)
    assert ReplaceRequest.from_json(req.to_json()) == req
    rec = HostRecord(restarts=[NOW], drained=[NOW + 1])
    assert HostRecord.from_json(rec.to_json()) == rec
    assert HostRecord.from_json(None) == HostRecord()


def test_a_confirmed_straggler_of_workers_that_save_nothing_is_kept_with_the_reason():
    from elastictrain.agent.straggler_replace import StragglerReplacer

    emitted = []
    replacer = StragglerReplacer(client=None, run_prefix="/elastictrain/r", policy=ReplacePolicy(), host="h",
                                 node=lambda: "n0", emit=lambda kind, fields: emitted.append((kind, fields)),
                                 reform=lambda: None, drain=lambda why: None)
    replacer.on_event("straggler_confirmed", {"slow_rank": 1, "step": 30, "lateness_s": 0.2, "saves": False})
    [(kind, fields)] = emitted
    assert kind == "straggler_kept" and fields["slow_rank"] == 1 and "save no checkpoint" in fields["reason"]
