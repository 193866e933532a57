"""Which bytes move over the group in a restore at another world size, and who sends them
(checkpoint/snapshot_exchange.py); the move itself runs in tests/integration/checkpoint/test_snapshot_reshard.py."""

from elastictrain.checkpoint.snapshot_exchange import Ask, merge, servers


def test_ranges_that_touch_overlap_or_lie_close_are_asked_for_as_one():
    assert merge([(100, 200), (0, 50), (50, 60), (150, 300), (300, 300)], gap=10) == ((0, 60), (100, 300))
    assert merge([(0, 10), (15, 20)], gap=5) == ((0, 20),)
    assert merge([(0, 10), (16, 20)], gap=5) == ((0, 10), (16, 20)), "apart by more than the gap: two messages"


def test_each_ask_is_served_by_a_rank_on_a_holding_node_preferring_one_that_reads_the_slot_anyway():
    nodes = ["a", "a", "b", "c"]
    holders = [{"a"}, {"a", "b"}]  # old rank 0 on a; old rank 1 on a and (a replica) on b
    asks = [(), (), (), (Ask(0, ((0, 8),), True), Ask(1, ((8, 16),), False))]
    needs = [(0,), (1,), (), (0, 1)]
    chosen = servers(asks, needs, holders, nodes)
    assert chosen == {(3, 0): 0, (3, 1): 1}, "old rank 1 from rank 1 (it reads it) rather than rank 0 or b's rank 2"
    needs = [(0,), (0,), (), (0, 1)]
    assert servers(asks, needs, holders, nodes) == {(3, 0): 0, (3, 1): 0}, "nobody reads old rank 1: the lowest"


def test_a_rank_never_serves_itself_and_an_ask_no_node_of_the_group_holds_has_no_server():
    asks = [(Ask(0, ((0, 8),), False),), (Ask(5, ((0, 8),), False),)]
    chosen = servers(asks, [(0,), ()], [{"a"}] + [set()] * 5, ["a", "b"])
    assert chosen == {}, chosen
