"""FedML's per-client data formats all read as the same tensors: DataLoaders over any Dataset,
FedML's lists of (x, y) batches (its MNIST/LEAF loaders), Datasets and (x, y) pairs."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.data.fedml_format import client_tensors, to_fedml_dataset, users_from_fedml_dataset


class Pairs(Dataset):
    """A map-style Dataset that is not a TensorDataset (as torchvision's are)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


X, Y = torch.randn(10, 1, 4, 4), torch.arange(10) % 3


@pytest.mark.parametrize("form", ["tensor_loader", "dataset_loader", "batches", "dataset", "pair"])
def test_every_fedml_format_gives_the_same_tensors(form):
    data = {
        "tensor_loader": DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True),
        "dataset_loader": DataLoader(Pairs(X, Y), batch_size=3, shuffle=True),
        "batches": [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 10, 4)],
        "dataset": Pairs(X, Y),
        "pair": (X, Y),
    }[form]
    x, y = client_tensors(data)
    assert torch.equal(x, X) and torch.equal(y, Y) and y.dtype == torch.long


def test_fedml_dataset_round_trip_and_clear_errors():
    users = [UserSplit(X, Y, X[:4], Y[:4]), UserSplit(X[:6], Y[:6], X[6:], Y[6:])]
    back = users_from_fedml_dataset(to_fedml_dataset(users, 3, batch_size=4))
    assert all(torch.equal(a, b) for u, v in zip(users, back) for a, b in zip(u, v))
    with pytest.raises(TypeError, match="expected a client's data in one of FedML's formats"):
        client_tensors("not data")
    with pytest.raises(TypeError, match="expected \\(x, y\\) batches in the client's list"):
        client_tensors([X, Y, X])
    with pytest.raises(ValueError, match="keyed 0..N-1"):
        users_from_fedml_dataset([0, 0, None, None, {}, {1: (X, Y)}, {1: (X, Y)}, 3])


def _as_format(x, y, kind):
    """One client's (x, y) in one of FedML's formats."""
    from torch.utils.data import DataLoader, TensorDataset

    if kind == "loader":
        return DataLoader(TensorDataset(x, y), batch_size=3)
    if kind == "list":
        return [(x[i : i + 3], y[i : i + 3]) for i in range(0, len(y), 3)]
    return (x, y)


def _dataset(train, test):
    return [None] * 5 + [dict(enumerate(train)), dict(enumerate(test))]


FORMATS = ["loader", "list", "pair"]


@pytest.mark.parametrize("kind", FORMATS)
def test_labels_and_images_are_converted_the_same_way_in_every_format(kind):
    import torch

    from fedml_perfedavg.core.types import model_inputs
    from fedml_perfedavg.data.fedml_format import users_from_fedml_dataset

    images = torch.arange(5 * 4, dtype=torch.uint8).reshape(5, 4)
    labels = torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0])
    [user] = users_from_fedml_dataset(_dataset([_as_format(images, labels, kind)], [_as_format(images, labels, kind)]))
    assert user.train_y.dtype == torch.int64 and user.train_y.tolist() == [0, 1, 2, 1, 0]
    # uint8 images are kept as stored, a quarter of float32's bytes; the model takes them scaled
    assert user.train_x.dtype == torch.uint8 and torch.equal(user.train_x, images)
    assert torch.equal(model_inputs(user.train_x), images.float() / 255)
    tokens = torch.randint(0, 80, (5, 7))  # an embedding model's inputs stay integer ids
    [user] = users_from_fedml_dataset(_dataset([_as_format(tokens, labels, kind)], [_as_format(tokens, labels, kind)]))
    assert torch.equal(user.train_x, tokens)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize(
    "labels,images,message",
    [
        ([0.0, 1.5, 2.0, 1.0, 0.0], None, r"client 1's training data: labels are not whole numbers \(e.g. \[1.5\]\)"),
        ([0, -1, 2, 1, 0], None, "client 1's training data: negative labels"),
        (None, "bool", "client 1's training data: inputs of dtype torch.bool"),
    ],
)
def test_labels_and_inputs_the_model_cannot_take_are_refused_naming_the_client(kind, labels, images, message):
    import torch

    from fedml_perfedavg.core.errors import ConfigError
    from fedml_perfedavg.data.fedml_format import users_from_fedml_dataset

    good_x, good_y = torch.rand(5, 4), torch.tensor([0, 1, 2, 1, 0])
    x = good_x if images is None else torch.ones(5, 4, dtype=getattr(torch, images))
    y = good_y if labels is None else torch.tensor(labels)
    clients = [_as_format(good_x, good_y, kind), _as_format(x, y, kind)]
    with pytest.raises(ConfigError, match=message):
        users_from_fedml_dataset(_dataset(clients, [_as_format(good_x, good_y, kind)] * 2))


def test_clients_without_training_or_test_samples_are_named():
    import torch

    from fedml_perfedavg.core.errors import ConfigError
    from fedml_perfedavg.data.fedml_format import users_from_fedml_dataset

    full = (torch.rand(5, 4), torch.tensor([0, 1, 2, 1, 0]))
    with pytest.raises(ConfigError, match="client 1 has no training samples"):
        users_from_fedml_dataset(_dataset([full, []], [full, full]))
    with pytest.raises(ConfigError, match=r"client\(s\) \[0, 2\] have no test samples"):
        users_from_fedml_dataset(_dataset([full, full, full], [[], full, (torch.empty(0, 4), torch.empty(0))]))


def test_a_silos_own_loader_may_key_its_one_client_as_it_likes():
    """Data-owner mode: a user's loader that returns FedML's tuple with the silo's client alone
    (under any key) is read as user R-1, and the dataset handed on is keyed so."""
    import pytest as _pytest

    from fedml_perfedavg.core.errors import ConfigError
    from fedml_perfedavg.data.fedml_format import own_user_from_fedml_dataset, to_fedml_dataset

    x, y = torch.rand(8, 1, 4, 4), torch.tensor([0, 1] * 4)
    user = UserSplit(x, y, x[:4], y[:4])
    alone = to_fedml_dataset([user], 2, 4)  # keyed 0, as a loader of one organization's data would
    mine, dataset = own_user_from_fedml_dataset(alone, 2)
    assert torch.equal(mine.train_x, x) and list(dataset[5]) == [2] and dataset[4] == {2: 8}
    everyone = to_fedml_dataset([user, user, user], 2, 4)
    assert list(own_user_from_fedml_dataset(everyone, 2)[1][5]) == [2]
    with _pytest.raises(ConfigError, match=r"silo rank 4 owns user 3, but its dataset holds clients \[0, 1, 2\]"):
        own_user_from_fedml_dataset(everyone, 3)
