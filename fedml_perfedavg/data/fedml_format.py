"""FedML's data format, both ways.

FedML hands algorithms an 8-element list ``[train_num, test_num, train_global, test_global,
train_num_dict, train_dict, test_dict, class_num]`` whose per-client entries are DataLoaders
over any Dataset (FedML's CIFAR-10 loaders) or lists of (x, y) batches (FedML's MNIST/LEAF
loaders). The algorithms work on each client's whole data as two tensors; these functions
convert, and :func:`to_fedml_dataset` builds FedML's list from the paper's split.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ..core.errors import ConfigError
from ..core.types import UserSplit, model_inputs, one_block


def client_tensors(data: Any) -> Tuple[Tensor, Tensor]:
    """(x, y) of all of one client's samples, from any of FedML's per-client formats: a
    DataLoader (over a ``TensorDataset`` or any map-style Dataset of (x, y) items), a list of
    (x, y) batches, a Dataset, or an (x, y) pair of tensors."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        return data[0], data[1]
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return data.tensors[0], data.tensors[1]
    if isinstance(data, Dataset):
        try:
            batches = list(DataLoader(data, batch_size=1024, shuffle=False))
        except Exception as err:  # noqa: BLE001 - any failure to iterate is the same problem for the user
            raise TypeError(f"cannot read (x, y) samples from {type(data).__name__}: {err}") from None
        return _concatenate(batches, type(data).__name__)
    if isinstance(data, list):
        return _concatenate(data, "list")
    raise TypeError(
        f"expected a client's data in one of FedML's formats (a DataLoader, a list of (x, y) "
        f"batches, a Dataset or an (x, y) pair), got {type(data).__name__}"
    )


def _concatenate(batches: Sequence[Any], what: str) -> Tuple[Tensor, Tensor]:
    if not batches:
        raise ValueError(f"a client's data ({what}) holds no samples")
    xs, ys = [], []
    for batch in batches:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"expected (x, y) batches in the client's {what}, got {type(batch).__name__}")
        x, y = batch
        xs.append(torch.as_tensor(x))
        ys.append(torch.as_tensor(y))
    return torch.cat(xs), torch.cat(ys)


def as_images(x: Tensor, where: str) -> Tensor:
    """Inputs the model can take, as stored: uint8 images kept as they are (scaled to [0, 1], as
    torchvision's ``ToTensor`` does, where they are used: core/types.py's ``model_inputs``); other
    dtypes as given (floating point inputs; integer token ids for embedding models such as FedML's
    ``rnn``); booleans and complex numbers refused."""
    if x.dtype == torch.bool or x.is_complex():
        raise ConfigError(
            f"{where}: inputs of dtype {x.dtype}; give floating point inputs, integer token ids, or "
            f"uint8 images (scaled to [0, 1] as torchvision's ToTensor does)"
        )
    return x


def as_labels(y: Tensor, where: str) -> Tensor:
    """Integer class labels (int64), the same in every format: integer dtypes, or floats that hold
    whole numbers; anything else is refused, never truncated."""
    y = y.reshape(-1) if y.dim() > 1 and y.shape[-1] == 1 else y
    if y.dim() != 1:
        raise ConfigError(f"{where}: labels of shape {tuple(y.shape)}; expected one class index per sample")
    if y.is_floating_point():
        if not bool(torch.isfinite(y).all()) or not bool((y == y.round()).all()):
            raise ConfigError(
                f"{where}: labels are not whole numbers (e.g. {y[y != y.round()][:3].tolist()}); expected class indices"
            )
    elif y.dtype == torch.bool or y.is_complex():
        raise ConfigError(f"{where}: labels of dtype {y.dtype}; expected class indices")
    y = y.long()
    if y.numel() and int(y.min()) < 0:
        raise ConfigError(f"{where}: negative labels (e.g. {int(y.min())}); expected class indices 0..C-1")
    return y


def client_samples(data: Any, where: str) -> Tuple[Tensor, Tensor]:
    """(inputs, class labels) of one client's FedML data, converted as :func:`as_images` and
    :func:`as_labels` say; ``where`` names the client in errors."""
    try:
        x, y = client_tensors(data)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None
    return as_images(x, where), as_labels(y, where)


def users_from_fedml_dataset(dataset: Sequence[Any], device: Optional[torch.device] = None) -> List[UserSplit]:
    """Every client's train and test tensors from FedML's 8-element dataset list, by client id,
    checked per client (samples on both sides, class labels, image dtypes), naming the client."""
    train_dict, test_dict = dataset[5], dataset[6]
    if sorted(train_dict) != list(range(len(train_dict))):
        raise ConfigError(f"FedML's per-client data must be keyed 0..N-1, got keys {sorted(train_dict)[:10]}...")
    users, without_test = [], []
    for client in range(len(train_dict)):
        tensors = []
        for split, data in (("training", train_dict[client]), ("test", test_dict.get(client))):
            where = f"client {client}'s {split} data"
            try:
                x, y = client_tensors(data) if data is not None else (torch.empty(0), torch.empty(0))
            except ValueError:  # an empty list or Dataset
                x, y = torch.empty(0), torch.empty(0)
            except TypeError as err:
                raise ConfigError(f"{where}: {err}") from None
            if len(y) != len(x):
                raise ConfigError(f"{where}: {len(x)} inputs but {len(y)} labels")
            if len(y) == 0:
                if split == "training":
                    raise ConfigError(
                        f"client {client} has no training samples; every client trains when sampled, "
                        f"so each needs training data (or leave it out of the dataset)"
                    )
                without_test.append(client)
                continue
            tensors += [as_images(x, where), as_labels(y, where)]
        if len(tensors) == 4:
            users.append(UserSplit(*(t.to(device) if device is not None else t for t in tensors)))
    if without_test:
        raise ConfigError(
            f"client(s) {without_test} have no test samples: the personalized accuracy is each user's "
            f"accuracy on its own test split after one alpha-step, so each user needs test data"
        )
    return users


class StoredSamples(TensorDataset):
    """A ``TensorDataset`` of samples as stored (uint8 images) whose items are as the model takes
    them (scaled to [0, 1]): FedML's own trainers iterate its loaders; the plugin reads
    ``tensors`` (:func:`client_tensors`) and scales rows where it uses them."""

    def __getitem__(self, index: Any) -> Tuple[Tensor, Tensor]:
        x, y = self.tensors
        return model_inputs(x[index]), y[index]


def to_fedml_dataset(
    users: Sequence[UserSplit], num_classes: int, batch_size: int, ids: Optional[Sequence[int]] = None
) -> list:
    """FedML's 8-element dataset list over ``users`` (keyed 0..n-1, or by ``ids``); per-client
    loaders wrap the same tensors. No users (the server of a data-owner run): empty dicts and no
    global loaders."""

    def loader(x: Tensor, y: Tensor, shuffle: bool) -> DataLoader:
        return DataLoader(StoredSamples(x, y), batch_size=batch_size, shuffle=shuffle)

    keys = list(range(len(users))) if ids is None else [int(i) for i in ids]
    train_local = {k: loader(u.train_x, u.train_y, True) for k, u in zip(keys, users)}
    test_local = {k: loader(u.test_x, u.test_y, False) for k, u in zip(keys, users)}
    train_num = {k: len(u.train_y) for k, u in zip(keys, users)}
    train_global = test_global = None
    if users:
        # the users' tensors as one, without a copy where they are views of one block (the paper's split)
        train_global = loader(one_block([u.train_x for u in users]), one_block([u.train_y for u in users]), True)
        test_global = loader(one_block([u.test_x for u in users]), one_block([u.test_y for u in users]), False)
    return [
        sum(train_num.values()),
        sum(len(u.test_y) for u in users),
        train_global,
        test_global,
        train_num,
        train_local,
        test_local,
        num_classes,
    ]


def own_user_from_fedml_dataset(
    dataset: Sequence[Any], user_id: int, device: Optional[torch.device] = None
) -> Tuple[UserSplit, list]:
    """A silo's own user from FedML's dataset list (data-owner mode): the client keyed
    ``user_id``, or the only client a loader of the silo's own data gave (under any key); and the
    dataset list with that client alone, keyed ``user_id`` (FedML's trainer reads it by that key)."""
    train_dict, test_dict = dataset[5], dataset[6]
    keys = sorted(train_dict)
    if user_id in train_dict:
        key = user_id
    elif len(keys) == 1:
        key = keys[0]
    else:
        raise ConfigError(
            f"comm_args.silo_data='own': silo rank {user_id + 1} owns user {user_id}, but its dataset "
            f"holds clients {keys[:10]}{'...' if len(keys) > 10 else ''} and not {user_id}; give the "
            f"silo its own data (data_args.data_cache_dir: its folder from fedml-perfedavg export-split, "
            f"or a loader that returns its client alone)"
        )
    [user] = users_from_fedml_dataset([None] * 5 + [{0: train_dict[key]}, {0: test_dict.get(key)}], device)
    numbers = dataset[4] if isinstance(dataset[4], dict) else {}
    own = list(dataset)
    own[4] = {user_id: numbers.get(key, len(user.train_y))}
    own[5], own[6] = {user_id: train_dict[key]}, {user_id: test_dict.get(key)}
    own[0], own[1] = len(user.train_y), len(user.test_y)
    return user, own
