"""A completed round whose members were pruned since (a lease that expired right as the round completed): the
handler must not hand out that round's world, which the pruned member does not share (rendezvous/etcd_handler.py,
`pruned_after_completion`; seen in the netns chaos run, where 2 nodes of a 3:3 job trained as a group of 2)."""

from __future__ import annotations

from elastictrain.rendezvous.etcd_handler import pruned_after_completion


def test_a_round_as_completed_is_kept():
    assert pruned_after_completion([0, 1, 2], min_nodes=3) is None
    assert pruned_after_completion([2, 0, 1], min_nodes=2) is None


def test_a_round_below_min_nodes_or_with_a_gap_in_its_ranks_is_left():
    assert "fewer than min_nodes 3" in pruned_after_completion([0, 1], min_nodes=3)
    assert "group ranks [0, 2]" in pruned_after_completion([0, 2], min_nodes=1)
