"""``fedml.data.load`` and ``fedml.model.create`` knowing the paper's split and model.

fedml/data/data_loader.py ``load`` knows FedML's own partitions (and downloads MNIST from
FedML's servers); fedml/model/model_hub.py ``create`` raises a bare ``Exception`` for names it
does not know. With the plugin installed, ``partition_method: paper`` (or
``paper_diff_hetero``) loads the paper's split from ``data_cache_dir`` offline, and
``model: mlp`` (the paper's MLP) or ``small_cnn`` are created; every other request is FedML's.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import socket
import sys
import threading
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..core.errors import ConfigError
from ..core.types import UserSplit
from ..data.fedml_format import to_fedml_dataset
from ..data.loading import FederatedData
from ..models import MODELS, create_model

logger = logging.getLogger(__name__)


def input_layout(model_name: str, dataset: str, input_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape of one sample FedML's own model ``model_name`` expects: FedML's MNIST
    loaders give flat 784-vectors (``lr``) and CNN_DropOut unsqueezes (28, 28) images (``cnn``)."""
    if dataset == "mnist" and model_name == "lr":
        return (input_shape[0] * input_shape[1] * input_shape[2],)
    if dataset == "mnist" and model_name == "cnn":
        return input_shape[1:]
    return input_shape


def reshaped(data: FederatedData, layout: Tuple[int, ...]) -> FederatedData:
    """The split with every sample reshaped to ``layout``."""
    if tuple(layout) == tuple(data.input_shape):
        return data
    users = [
        UserSplit(
            u.train_x.reshape(len(u.train_y), *layout), u.train_y, u.test_x.reshape(len(u.test_y), *layout), u.test_y
        )
        for u in data.users
    ]
    return FederatedData(users, data.num_classes, data.input_shape, data.user_ids)


def leaf_folders(root: str, name: str) -> Tuple[List[str], bool]:
    """LEAF's train and test folders of dataset ``name`` under ``root``, and whether both hold
    their JSON files (what FedML's LEAF loaders read)."""
    folders = [os.path.join(root, name, split) for split in ("train", "test")]
    return folders, all(glob.glob(os.path.join(folder, "*.json")) for folder in folders)


def complete_fedml_loader_arguments(args: Any) -> None:
    """What FedML's loaders read and the plugin's YAML may not say: fedml/data/data_loader.py reads
    ``args.partition_alpha`` for every CIFAR-style partition (an AttributeError when the YAML has
    none), though only ``hetero`` uses it."""
    if not hasattr(args, "partition_alpha"):
        if getattr(args, "partition_method", None) == "hetero":
            raise ConfigError(
                f"data_args.partition_alpha: not given; FedML's {getattr(args, 'dataset', None)!r} loader with "
                f"partition_method 'hetero' draws each client's classes from Dirichlet(partition_alpha): give it "
                f"(FedML's examples use 0.5)"
            )
        args.partition_alpha = None  # read by FedML for every partition; unused but by 'hetero'


def leaf_loaded(args: Any) -> Optional[Tuple[list, int]]:
    """FedML's LEAF loaders for MNIST and Shakespeare (``fedml.data.load``'s result), with their
    folders under ``data_cache_dir`` given as arguments, or None for any other dataset.

    FedML's ``load_synthetic_data`` (fedml/data/data_loader.py) calls ``download_mnist`` before
    MNIST's loader, which fetches MNIST.zip from FedML's server whenever the zip is missing, even
    beside the extracted files it then reads; and Shakespeare's loader reads
    "../../../data/shakespeare", relative to wherever the process was started. Here FedML's own
    functions read the folders the YAML names (``load_partition_data_mnist``, Shakespeare's
    ``read_data`` and ``batch_data``), and the ending is ``load_synthetic_data``'s own (a
    centralized or full-batch run's clients merged): the same dataset, nothing of FedML replaced."""
    dataset = getattr(args, "dataset", None)
    if dataset not in ("mnist", "shakespeare") or (dataset == "mnist" and bool(getattr(args, "download", False))):
        return None  # (MNIST with download: true is FedML's own path, which fetches the zip where it is missing)
    root = os.path.abspath(str(getattr(args, "data_cache_dir", ".")))
    folders, present = leaf_folders(root, "MNIST" if dataset == "mnist" else "shakespeare")
    if not present:
        if dataset == "mnist":
            raise ConfigError(
                f"data_args.dataset='mnist' with data_args.partition_method="
                f"{getattr(args, 'partition_method', None)!r} is FedML's MNIST loader, which reads LEAF's "
                f"JSON files from {folders[0]}/*.json and {folders[1]}/*.json (FedML's MNIST.zip, extracted "
                f"into {root}) and would download them: put them there, set data_args.download: true to "
                f"let FedML download them, or use partition_method: paper (the paper's split, from "
                f"torchvision's MNIST files)"
            )
        raise ConfigError(
            f"data_args.dataset='shakespeare' is FedML's LEAF Shakespeare, read from {folders[0]}/*.json and "
            f"{folders[1]}/*.json (data_args.data_cache_dir={root!r}), which are not there: put LEAF's "
            f"Shakespeare files there"
        )
    # load_synthetic_data's start: both decided before loading, from the YAML's values
    centralized = args.client_num_in_total == 1 and args.training_type != "cross_silo"
    asked_batch_size = args.batch_size
    full_batch = args.batch_size <= 0
    if full_batch:
        args.batch_size = 128  # FedML's temporary batch size
    if dataset == "mnist":
        from fedml.data.MNIST.data_loader import load_partition_data_mnist

        loaded = load_partition_data_mnist(args, args.batch_size, train_path=folders[0], test_path=folders[1])
    else:
        loaded = _shakespeare(args.batch_size, *folders)
    (client_num, train_num, test_num, train_global, test_global, local_num, train_local, test_local, classes) = loaded
    args.client_num_in_total = client_num
    if centralized:
        local_num = {0: sum(local_num.values())}
        train_local = {0: [batch for c in sorted(train_local) for batch in train_local[c]]}
        test_local = {0: [batch for c in sorted(test_local) for batch in test_local[c]]}
        args.client_num_in_total = 1
    if full_batch:
        from fedml.data.data_loader import combine_batches

        train_global, test_global = combine_batches(train_global), combine_batches(test_global)
        train_local = {c: combine_batches(train_local[c]) for c in train_local}
        test_local = {c: combine_batches(test_local[c]) for c in test_local}
        args.batch_size = asked_batch_size
    return [train_num, test_num, train_global, test_global, local_num, train_local, test_local, classes], classes


def _shakespeare(batch_size: int, train_folder: str, test_folder: str) -> tuple:
    """fedml/data/shakespeare/data_loader.py ``load_partition_data_shakespeare`` with its two
    folders as arguments (FedML's has them fixed, relative to the working directory)."""
    from fedml.data.shakespeare.data_loader import batch_data, read_data
    from fedml.data.shakespeare.language_utils import VOCAB_SIZE

    users, _, train_data, test_data = read_data(train_folder, test_folder)
    train_num = test_num = 0
    local_num, train_local, test_local, train_global, test_global = {}, {}, {}, [], []
    for client, user in enumerate(users):
        train_num += len(train_data[user]["x"])
        test_num += len(test_data[user]["x"])
        local_num[client] = len(train_data[user]["x"])
        train_local[client] = batch_data(train_data[user], batch_size)
        test_local[client] = batch_data(test_data[user], batch_size)
        train_global += train_local[client]
        test_global += test_local[client]
    return len(users), train_num, test_num, train_global, test_global, local_num, train_local, test_local, VOCAB_SIZE


@contextlib.contextmanager
def offline_fedml_loader(args: Any) -> Iterator[None]:
    """FedML's own loaders (fedml/data/data_loader.py), offline unless ``data_args.download``: a
    loader that opens a connection without ``download: true`` is stopped before it connects."""
    if bool(getattr(args, "download", False)):
        yield
        return
    root = os.path.abspath(str(getattr(args, "data_cache_dir", ".")))
    dataset = getattr(args, "dataset", None)

    def refused(address: Any) -> ConfigError:
        return ConfigError(
            f"data_args.dataset={dataset!r}: FedML's loader tried to download it (a connection to "
            f"{address}); put its files under data_args.data_cache_dir={root!r}, or set "
            f"data_args.download: true"
        )

    with _offline_in_this_thread(refused):
        yield


_OFFLINE = threading.local()  # .refused: what a connection or name lookup from this thread raises now
_AUDITING = False


def _refuse_network(event: str, args: Tuple[Any, ...]) -> None:
    """An audit hook (sys.addaudithook): inert but on a thread inside :func:`_offline_in_this_thread`,
    where an outside connection or a name lookup raises its error before anything leaves."""
    refused = getattr(_OFFLINE, "refused", None)
    if refused is None:
        return
    if event == "socket.connect":
        sock, address = args[0], args[1]
        if getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6):
            raise refused(address)
    elif event == "socket.getaddrinfo":  # offline, the name lookup fails first (a bare URLError)
        host, port = args[0], args[1]
        if host not in (None, "localhost", b"localhost") and not _is_address(host):
            raise refused(f"{host}:{port}")


@contextlib.contextmanager
def _offline_in_this_thread(refused: Callable[[Any], ConfigError]) -> Iterator[None]:
    """No connection leaves this thread meanwhile. Scoped by an audit hook, not by replacing
    ``socket``'s functions: every other thread, and this one afterwards, is left as it was (an
    audit hook cannot be removed; this one does nothing outside the block)."""
    global _AUDITING
    if not _AUDITING:
        sys.addaudithook(_refuse_network)
        _AUDITING = True
    previous = getattr(_OFFLINE, "refused", None)
    _OFFLINE.refused = refused
    try:
        yield
    finally:
        _OFFLINE.refused = previous


def _is_address(host: Any) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host))
    except ValueError:
        return False
    return True


def loading_with_paper_split(
    original_load: Callable,
    load_split: Callable[[Any], Optional[FederatedData]],
    asks_for_plugin: Callable[[Any], bool],
) -> Callable:
    """A replacement for ``fedml.data.load``: the split ``load_split`` gives where it gives one
    (the paper's; a silo's own folder; no users at all for the server of a data-owner run). FedML's
    own loaders run offline (unless ``data_args.download``) for runs that ``asks_for_plugin`` (a
    plugin algorithm, or ``common_args.plugin_fixes``); for any other run they are FedML's, as is."""

    @functools.wraps(original_load)
    def load(args):
        data = load_split(args)
        if data is None:
            if not asks_for_plugin(args):
                return original_load(args)
            complete_fedml_loader_arguments(args)
            with offline_fedml_loader(args):
                leaf = leaf_loaded(args)
                return leaf if leaf is not None else original_load(args)
        if data.users:
            data = reshaped(data, input_layout(getattr(args, "model", ""), args.dataset, data.input_shape))
        return to_fedml_dataset(data.users, data.num_classes, int(args.batch_size), data.user_ids), data.num_classes

    load.__wrapped__ = original_load
    return load


def creating_paper_models(original_create: Callable, asks_for_plugin: Callable[[Any], bool]) -> Callable:
    """A replacement for ``fedml.model.create``: the plugin's models by name, else FedML's. For
    runs that ``asks_for_plugin`` (a plugin algorithm, or ``common_args.plugin_fixes``) every model
    starts from ``random_seed`` whatever the data loading drew, and FedML's bare ``Exception`` for
    an unknown name is a clear error; any other run's FedML model is FedML's call, as is."""

    def _create(name: Any, args: Any, output_dim: int) -> nn.Module:
        if name in MODELS:
            shape = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32)}.get(str(getattr(args, "dataset", None)))
            if shape is None:
                raise ConfigError(
                    f"model_args.model={name!r}: the plugin's models are built for data_args.dataset "
                    f"mnist or cifar10, not {getattr(args, 'dataset', None)!r}"
                )
            return create_model(name, shape, int(output_dim), getattr(args, "hidden_sizes", None) or (80, 60))
        try:
            return original_create(args, output_dim)
        except Exception as err:
            if type(err) is not Exception:
                raise
            raise ConfigError(
                f"model_args.model={name!r}: FedML has no such model for data_args.dataset="
                f"{getattr(args, 'dataset', None)!r} ({err}); the plugin adds {list(MODELS)}, and FedML "
                f"knows e.g. lr, cnn (mnist), resnet56, mobilenet"
            ) from None

    @functools.wraps(original_create)
    def create(args, output_dim) -> nn.Module:
        name = getattr(args, "model", None)
        if name not in MODELS and not asks_for_plugin(args):
            return original_create(args, output_dim)
        # The same initial model in every process of a run (sp, MPI ranks, silos), without
        # reseeding the caller's global RNG as a side effect.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(getattr(args, "random_seed", 0)))
            return _create(name, args, output_dim)

    create.__wrapped__ = original_create
    return create
