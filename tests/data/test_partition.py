"""The paper's split: exact per-user counts, disjointness, determinism."""

import numpy as np
import pytest
import torch

from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.data.loading import (
    check_paper_split,
    default_test_images_per_class,
    load_federated,
    split_over_users,
)
from fedml_perfedavg.data.partition import partition_indices, plan_users, resampled_indices

from tests.helpers import needs_mnist


def _check_paper_counts(users, a, diff_hetero=False, train=True):
    for i, u in enumerate(users):
        y = (u.train_y if train else u.test_y).tolist()
        counts = {c: y.count(c) for c in set(y)}
        if i < len(users) // 2:
            assert counts == {c: a for c in range(5)}, (i, counts)
        else:
            high = [c for c in counts if c >= 5]
            low = [c for c in counts if c < 5]
            assert len(high) == 1 and counts[high[0]] == 2 * a, (i, counts)
            if diff_hetero:
                assert low == [], (i, counts)
            else:
                assert len(low) == 1 and counts[low[0]] == a // 2, (i, counts)


@pytest.mark.parametrize("a", [196, 68])
def test_plans_match_the_paper(a):
    plans = plan_users(50, a, "paper", seed=0)
    assert [p.total for p in plans] == [5 * a] * 25 + [a // 2 + 2 * a] * 25
    # every class of 0-4 and of 5-9 goes to five second-half users
    lows = [min(p.class_counts) for p in plans[25:]]
    highs = [max(p.class_counts) for p in plans[25:]]
    assert sorted(lows) == sorted(list(range(5)) * 5) and sorted(highs) == sorted(list(range(5, 10)) * 5)
    hetero = plan_users(50, a, "paper_diff_hetero", seed=0)
    assert [p.total for p in hetero] == [5 * a] * 25 + [2 * a] * 25


def test_partition_is_disjoint_deterministic_and_seed_dependent():
    labels = np.repeat(np.arange(10), 5000)  # CIFAR-10 train label counts
    plans = plan_users(50, 68, "paper", 0)
    users = partition_indices(labels, plans, 0)
    flat = np.concatenate(users)
    assert len(flat) == len(set(flat.tolist())) == 25 * 340 + 25 * 170
    for u, p in zip(users, plans):
        assert {c: int((labels[u] == c).sum()) for c in p.class_counts} == p.class_counts
    again = partition_indices(labels, plan_users(50, 68, "paper", 0), 0)
    assert all(np.array_equal(x, y) for x, y in zip(users, again))
    other = partition_indices(labels, plan_users(50, 68, "paper", 1), 1)
    assert not all(np.array_equal(x, y) for x, y in zip(users, other))


def test_a_resampled_population_outgrows_the_dataset_with_the_papers_counts_per_user():
    """paper_resampled: the paper's class counts per user, each user's images drawn on its own
    (none twice within a user), for more users than the disjoint split has images for."""
    labels = np.repeat(np.arange(10), 500)
    plans = plan_users(400, 40, "paper_resampled", 0)
    assert plans == plan_users(400, 40, "paper", 0)  # the paper's plan
    users = resampled_indices(labels, plans, 0, "data_args.images_per_class=40")
    for u, p in zip(users, plans):
        assert len(set(u.tolist())) == len(u) == p.total
        assert {c: int((labels[u] == c).sum()) for c in p.class_counts} == p.class_counts
    assert sum(map(len, users)) > len(labels)  # more than the data holds: users share images
    again = resampled_indices(labels, plan_users(400, 40, "paper_resampled", 0), 0, "k")
    assert all(np.array_equal(x, y) for x, y in zip(users, again))
    assert not np.array_equal(users[0], resampled_indices(labels, plans, 1, "k")[0])
    with pytest.raises(ConfigError, match="data_args.images_per_class=40"):
        partition_indices(labels, plans, 0, "data_args.images_per_class=40")  # the disjoint split cannot
    # the split's tensors: the users are views of one stored block, as the paper split's are
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (5000, 1, 2, 2), generator=g, dtype=torch.uint8)
    test = (images[:1000], torch.as_tensor(np.repeat(np.arange(10), 100)))
    split = split_over_users((images, torch.as_tensor(labels)), test, 400, 40, 8, "paper_resampled", 0)
    assert [len(u.train_y) for u in split] == [p.total for p in plans]
    starts = [u.train_x.data_ptr() for u in split]
    assert all(b - a == len(u.train_y) * 4 for a, b, u in zip(starts, starts[1:], split))


def test_a_resampled_split_is_refused_only_where_one_user_needs_more_than_a_class_holds():
    smallest, a = check_paper_split("mnist", 20_000, 196, None, "paper_resampled", 0)
    assert (smallest, a) == (98 + 392, 196)
    with pytest.raises(ConfigError, match="client_num_in_total"):
        check_paper_split("mnist", 20_000, 196, None, "paper", 0)
    with pytest.raises(ConfigError, match=r"images_per_class=3000: a user would need 6000 images of class \d"):
        check_paper_split("mnist", 50, 3000, None, "paper_resampled", 0)


def test_bad_partition_arguments_name_the_key():
    with pytest.raises(ValueError, match="partition_method='iid'"):
        plan_users(50, 196, "iid", 0)
    with pytest.raises(ValueError, match="client_num_in_total=7"):
        plan_users(7, 196, "paper", 0)
    with pytest.raises(ValueError, match="images_per_class=5"):
        plan_users(50, 5, "paper", 0)
    with pytest.raises(ValueError, match="only .* left"):
        partition_indices(np.repeat(np.arange(10), 100), plan_users(50, 196, "paper", 0), 0)


@needs_mnist
def test_real_mnist_split_matches_the_paper_exactly(mnist_root):
    data = load_federated("mnist", mnist_root, 50, "paper", seed=0)
    assert default_test_images_per_class(196, 60000, 10000) == 32
    _check_paper_counts(data.users, 196)
    _check_paper_counts(data.users, 32, train=False)
    for train_u, test_u in zip(data.users, data.users):
        assert set(train_u.train_y.tolist()) == set(test_u.test_y.tolist())  # same classes in test
    again = load_federated("mnist", mnist_root, 50, "paper", seed=0)
    assert all(
        torch.equal(u.train_x, v.train_x) and torch.equal(u.test_y, v.test_y) for u, v in zip(data.users, again.users)
    )
    hetero = load_federated("mnist", mnist_root, 50, "paper_diff_hetero", seed=0)
    _check_paper_counts(hetero.users, 196, diff_hetero=True)
    x = data.users[0].train_x  # stored as read; the model takes x / 255 (core/types.py: model_inputs)
    assert x.shape[1:] == (1, 28, 28) and x.dtype == torch.uint8 and int(x.max()) == 255


def test_cifar10_path_on_generated_files(fake_cifar_root):
    data = load_federated("cifar10", fake_cifar_root, 10, "paper", seed=0, images_per_class=8, test_images_per_class=2)
    assert data.input_shape == (3, 32, 32) and data.users[0].train_x.shape[1:] == (3, 32, 32)
    _check_paper_counts(data.users, 8)
    _check_paper_counts(data.users, 2, train=False)
    assert default_test_images_per_class(68, 50000, 10000) == 12


def test_missing_dataset_says_where_files_were_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py.*data_args.download"):
        load_federated("cifar10", str(tmp_path), 10, "paper", seed=0)
    with pytest.raises(FileNotFoundError, match=r"MNIST/raw"):
        load_federated("mnist", str(tmp_path), 10, "paper", seed=0)


def test_too_few_images_is_a_config_error_naming_the_key_and_the_data(fake_cifar_root):
    from fedml_perfedavg.core.errors import ConfigError

    # the generated files hold 50 training images per class; 10 users with a=40 need 200 of class 0-4
    with pytest.raises(
        ConfigError,
        match=r"data_args.images_per_class=40: user \d+ needs \d+ images of class \d "
        r"but the data holds 50 of that class for 10 users",
    ):
        load_federated("cifar10", fake_cifar_root, 10, "paper", 0, images_per_class=40, test_images_per_class=2)
    with pytest.raises(ConfigError, match=r"data_args.test_images_per_class=30: .* holds 20 of that class"):
        load_federated("cifar10", fake_cifar_root, 10, "paper", 0, images_per_class=4, test_images_per_class=30)


def test_cifar10_files_that_fail_their_checksum_are_named_as_damaged_not_missing(tmp_path):
    from tests.helpers_cifar import write_fake_cifar10

    root = write_fake_cifar10(str(tmp_path / "cifar"))  # generated: they cannot match CIFAR-10's md5s
    with pytest.raises(ConfigError, match=r"\['data_batch_1', .*'test_batch'\] are there but fail torchvision's MD5"):
        load_federated("cifar10", root, 10, "paper", seed=0)
