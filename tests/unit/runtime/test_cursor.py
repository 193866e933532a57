from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from elastictrain.runtime.cursor import ElasticCursor, GlobalOrder


def run_schedule(order, G, m, schedule):
    """schedule: list of (world_size, steps). Per step: (positions consumed by all ranks, samples in position order)."""
    cursor = ElasticCursor(order, G, m)
    steps, step = [], 0
    for W, n in schedule:
        for _ in range(n):
            plans = [cursor.plan(step, r, W) for r in range(W)]
            # every rank runs the same number of micro-batches, or collectives would not line up
            assert len({len(p.micro_batches) for p in plans}) == 1
            pairs = [(pos, s) for p in plans for mb in p.micro_batches if mb is not None
                     for pos, s in zip(mb.positions, mb.samples)]
            steps.append(([pos for pos, _ in pairs], [s for _, s in sorted(pairs)]))
            cursor.advance()
            step += 1
    return steps


@settings(max_examples=200, deadline=None)
@given(
    G_micro=st.integers(1, 12), m=st.integers(1, 4), n=st.integers(5, 200),
    schedule=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 6)), min_size=1, max_size=8),
)
def test_every_sample_consumed_exactly_once_over_any_world_size_changes(G_micro, m, n, schedule):
    G = G_micro * m
    order = GlobalOrder(n, seed=3)
    steps = run_schedule(order, G, m, schedule)
    total = sum(k for _, k in schedule) * G
    all_positions = [p for pos, _ in steps for p in pos]
    assert sorted(all_positions) == list(range(total))          # each global position exactly once
    for positions, _ in steps:
        assert len(positions) == G                             # the global batch is constant
    # each epoch is a permutation of the dataset: within an epoch no sample repeats
    samples = [s for _, smp in steps for s in smp]
    for e in range(0, len(samples), n):
        chunk = samples[e:e + n]
        assert len(chunk) == len(set(chunk))


@settings(max_examples=50, deadline=None)
@given(W1=st.integers(1, 8), W2=st.integers(1, 8), steps=st.integers(1, 10))
def test_step_contents_do_not_depend_on_world_size(W1, W2, steps):
    order = GlobalOrder(1000, seed=11)
    a = run_schedule(order, 16, 2, [(W1, steps)])
    b = run_schedule(order, 16, 2, [(W2, steps)])
    assert [sorted(s) for _, s in a] == [sorted(s) for _, s in b]


def test_order_depends_only_on_seed_and_epoch():
    a, b, c = GlobalOrder(100, 1), GlobalOrder(100, 1), GlobalOrder(100, 2)
    assert a.lookup(range(250)) == b.lookup(range(250))
    assert a.lookup(range(100)) != c.lookup(range(100))
    # epochs are shuffled differently, each is a full permutation
    e0, e1 = a.lookup(range(100)), a.lookup(range(100, 200))
    assert sorted(e0) == sorted(e1) == list(range(100)) and e0 != e1


def test_cursor_state_round_trip_resumes_at_the_same_position():
    order = GlobalOrder(50, seed=5)
    c1 = ElasticCursor(order, 8, 2)
    for _ in range(9):
        c1.advance()
    c2 = ElasticCursor(GlobalOrder(50, seed=5), 8, 2)
    c2.load_state_dict(c1.state_dict())
    assert c2.plan(9, 0, 2) == c1.plan(9, 0, 2)
    assert c1.state_dict() == {"samples_consumed": 72, "epoch": 1}


def test_more_ranks_than_micro_batches_pads_with_empty_micro_batches():
    c = ElasticCursor(GlobalOrder(100, 0), 4, 2)  # 2 micro-batches
    plans = [c.plan(0, r, 3) for r in range(3)]
    assert [len(p.micro_batches) for p in plans] == [1, 1, 1]
    assert plans[2].micro_batches == (None,)
    assert Counter(s for p in plans for s in p.samples).most_common(1)[0][1] == 1
