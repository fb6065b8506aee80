import torch

from fedml_perfedavg.core.sampling import (
    Purpose,
    batch_indices,
    batch_indices_of_many,
    generator_for,
    sample_clients,
    sample_local_batches,
)


def test_client_sampling_is_uniform_without_replacement_and_keyed_by_seed_and_round():
    a = sample_clients(0, 3, 50, 10)
    assert len(set(a)) == 10 and all(0 <= c < 50 for c in a)
    assert a == sample_clients(0, 3, 50, 10)
    assert a != sample_clients(0, 4, 50, 10) and a != sample_clients(1, 3, 50, 10)
    counts = torch.zeros(50)
    for r in range(2000):
        counts[sample_clients(0, r, 50, 10)] += 1
    assert (counts / 2000 - 0.2).abs().max() < 0.05  # each user is picked with probability r = 0.2


def test_d_dprime_dsecond_are_independent_batches_without_repeats():
    idx = batch_indices(
        100, steps=5, batch_sizes=[40, 30, 20], generator=generator_for(0, 0, 0, Purpose.LOCAL_TRAINING)
    )
    assert [tuple(i.shape) for i in idx] == [(5, 40), (5, 30), (5, 20)]
    for role in idx:
        for row in role:
            assert len(set(row.tolist())) == len(row)
    assert not torch.equal(idx[0][:, :20], idx[1][:, :20]) and not torch.equal(idx[0][:, :20], idx[2])
    assert not torch.equal(idx[0][0], idx[0][1])


def test_batches_depend_only_on_seed_round_client():
    x, y = torch.randn(50, 3), torch.arange(50)
    make = lambda *key: sample_local_batches(x, y, 2, [4, 4, 4], generator_for(*key, Purpose.LOCAL_TRAINING))  # noqa
    assert torch.equal(make(0, 1, 2).y, make(0, 1, 2).y)
    assert not torch.equal(make(0, 1, 2).y, make(0, 1, 3).y)
    assert not torch.equal(make(0, 1, 2).y, make(0, 2, 2).y)
    b = make(0, 1, 2)
    assert torch.equal(b.second_x, x[b.second_y])


def test_held_out_users_are_never_sampled_for_training():
    from fedml_perfedavg.core.sampling import held_out_users

    held = held_out_users(0, 50, 0.1)
    assert len(held) == 5 and held == held_out_users(0, 50, 0.1) and held != held_out_users(1, 50, 0.1)
    for r in range(300):
        assert not set(sample_clients(0, r, 50, 10, 0.1)) & set(held)
    assert sample_clients(0, 3, 50, 10, 0.0) == sample_clients(0, 3, 50, 10)


def test_random_iterate_step_is_keyed_and_uniform_over_the_local_steps():
    from collections import Counter

    from fedml_perfedavg.core.sampling import random_iterate_step

    draws = [random_iterate_step(0, r, 4) for r in range(4000)]
    assert draws == [random_iterate_step(0, r, 4) for r in range(4000)]  # same key, same t_k
    counts = Counter(draws)
    assert set(counts) == {0, 1, 2, 3} and all(900 < n < 1100 for n in counts.values())
    assert draws != [random_iterate_step(1, r, 4) for r in range(4000)]


def _one_client_reference(num_samples, steps, batch_sizes, generator):
    """The keyed draw as one client alone makes it (the code before batch_indices_of_many)."""
    keys = torch.rand(steps, len(batch_sizes), num_samples, generator=generator)
    chosen = keys.topk(max(batch_sizes), dim=-1, largest=False).indices
    return [chosen[:, role, :size] for role, size in enumerate(batch_sizes)]


def test_the_keyed_minibatch_streams_are_pinned():
    # Literal values drawn by the code of issue 25's start: a change of the streams fails here.
    first = batch_indices(980, 10, [40, 40, 40], generator_for(0, 7, 3, Purpose.LOCAL_TRAINING))
    assert first[0][0, :8].tolist() == [902, 641, 933, 326, 878, 358, 629, 231]
    assert first[2][9, -5:].tolist() == [63, 608, 774, 294, 803]
    second = batch_indices(490, 10, [40, 40, 40], generator_for(0, 7, 4, Purpose.LOCAL_TRAINING))
    assert second[1][4, :8].tolist() == [469, 136, 96, 464, 117, 212, 159, 476]


def test_many_clients_drawn_together_get_what_each_draws_alone():
    sizes, clients = [980, 490, 980, 45, 490, 980], [3, 8, 11, 2, 40, 5]
    together = batch_indices_of_many(
        sizes, 4, [40, 30, 20], [generator_for(0, 2, c, Purpose.LOCAL_TRAINING) for c in clients]
    )
    for count, client, got in zip(sizes, clients, together):
        expected = _one_client_reference(count, 4, [40, 30, 20], generator_for(0, 2, client, Purpose.LOCAL_TRAINING))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_topk_picks_ties_in_a_stack_of_rows_as_in_each_row_alone():
    # What batch_indices_of_many relies on: keys come from 2**24 values, so ties happen over a
    # long run, and the rows of one size are selected in one call.
    rows = torch.randint(0, 6, (12, 3, 200), generator=torch.Generator().manual_seed(0)).float() / 8
    together = rows.topk(40, dim=-1, largest=False).indices
    for i in range(len(rows)):
        assert torch.equal(together[i], rows[i].topk(40, dim=-1, largest=False).indices)


def test_the_keyed_order_begins_with_the_keyed_sample_and_lost_users_places_go_to_the_next():
    from fedml_perfedavg.core.sampling import keyed_order, reserve_problem, sample_clients, with_reserves

    for round_idx in range(20):
        order = keyed_order(3, round_idx, 10, 4)
        assert sorted(order) == list(range(10)) and sorted(order[:4]) == sample_clients(3, round_idx, 10, 4)
    order = keyed_order(3, 5, 10, 4)
    assert with_reserves(order, 4, [], 1) == sorted(order[:4])  # nobody lost: the sample itself
    assert with_reserves(order, 4, [order[1]], 1) == sorted(order[:1] + order[2:5])
    assert with_reserves(order, 4, [order[1], order[2]], 1) == sorted([order[0], order[3], order[4]])  # one reserve
    assert reserve_problem(order, 4, 1, sorted(order[:1] + order[2:5])) is None
    assert reserve_problem(order, 4, 1, [order[0], order[3]]) is None  # a short round is the server's to explain
    assert "at most 4 of the round's keyed order's first 4 + secagg_args.reserve_silos=1" in reserve_problem(
        order, 4, 1, [order[0], order[5]]
    )
    assert reserve_problem(order, 4, 1, order[:5]) is not None  # five in a round of four
    assert keyed_order(3, 5, 4, 4) == [0, 1, 2, 3]  # every user sampled: no order to draw
