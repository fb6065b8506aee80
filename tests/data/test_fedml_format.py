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
    data = {"tensor_loader": DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True),
            "dataset_loader": DataLoader(Pairs(X, Y), batch_size=3, shuffle=True),
            "batches": [(X[i:i + 4], Y[i:i + 4]) for i in range(0, 10, 4)],
            "dataset": Pairs(X, Y), "pair": (X, Y)}[form]
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
