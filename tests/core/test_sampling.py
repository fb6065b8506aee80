import torch

from fedml_perfedavg.core.sampling import Purpose, batch_indices, generator_for, sample_clients, sample_local_batches


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
    idx = batch_indices(100, steps=5, batch_sizes=[40, 30, 20], generator=generator_for(0, 0, 0, Purpose.LOCAL_TRAINING))
    assert [tuple(i.shape) for i in idx] == [(5, 40), (5, 30), (5, 20)]
    for role in idx:
        for row in role:
            assert len(set(row.tolist())) == len(row)
    assert not torch.equal(idx[0][:, :20], idx[1][:, :20]) and not torch.equal(idx[0][:, :20], idx[2])
    assert not torch.equal(idx[0][0], idx[0][1])


def test_batches_depend_only_on_seed_round_client():
    x, y = torch.randn(50, 3), torch.arange(50)
    make = lambda *key: sample_local_batches(x, y, 2, [4, 4, 4], generator_for(*key, Purpose.LOCAL_TRAINING))  # noqa
    assert torch.equal(make(0, 1, 2).adapt_y, make(0, 1, 2).adapt_y)
    assert not torch.equal(make(0, 1, 2).adapt_y, make(0, 1, 3).adapt_y)
    assert not torch.equal(make(0, 1, 2).adapt_y, make(0, 2, 2).adapt_y)
    b = make(0, 1, 2)
    assert torch.equal(b.meta_x, x[b.meta_y])


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
