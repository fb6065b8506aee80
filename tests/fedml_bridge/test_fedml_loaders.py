"""FedML's own loaders with the plugin installed: what their YAML may leave out is handled or
named, ``data_cache_dir`` is where they read, and offline a download is refused by name."""

import json
from types import SimpleNamespace

import pytest

from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.fedml_bridge.bootstrap import import_fedml
from fedml_perfedavg.fedml_bridge.data_and_models import loading_with_paper_split

import_fedml()
import fedml.data.data_loader as fedml_loader  # noqa: E402

pytestmark = pytest.mark.fast


def _load(**given):
    args = SimpleNamespace(client_num_in_total=2, batch_size=4, download=False, training_type="simulation", **given)
    original = getattr(fedml_loader.load, "__wrapped__", fedml_loader.load)
    return loading_with_paper_split(original, lambda a: None, lambda a: True)(args)  # a plugin run


def test_a_run_that_does_not_ask_for_the_plugin_gets_fedmls_loader_as_is():
    """Issue 77: FedML's own algorithm, no plugin_fixes: FedML's loader, called with the args
    untouched and no offline guard (what it does without the plugin)."""
    seen = []

    def fedmls(args):
        seen.append(dict(vars(args)))
        return "FedML's"

    args = SimpleNamespace(dataset="cifar100", partition_method="homo", download=False)
    assert loading_with_paper_split(fedmls, lambda a: None, lambda a: False)(args) == "FedML's"
    assert seen == [{"dataset": "cifar100", "partition_method": "homo", "download": False}]
    loading_with_paper_split(fedmls, lambda a: None, lambda a: True)(args)  # a plugin run: FedML's args completed
    assert seen[1] == {**seen[0], "partition_alpha": None}


def test_cifar100_without_partition_alpha_names_the_key_and_offline_names_the_download(tmp_path):
    with pytest.raises(ConfigError, match=r"data_args.partition_alpha: not given; FedML's 'cifar100' loader"):
        _load(dataset="cifar100", data_cache_dir=str(tmp_path), partition_method="hetero")
    # Offline the name lookup failed first, and FedML's loader gave a bare URLError.
    with pytest.raises(ConfigError, match=r"data_args.dataset='cifar100': FedML's loader tried to download it"):
        _load(dataset="cifar100", data_cache_dir=str(tmp_path), partition_method="hetero", partition_alpha=0.5)
    with pytest.raises(ConfigError, match=r"tried to download it .*data_args.download: true"):
        _load(dataset="cifar100", data_cache_dir=str(tmp_path), partition_method="homo")


def _leaf_shakespeare(folder, users):
    for split, count in (("train", 6), ("test", 2)):
        (folder / split).mkdir(parents=True)
        data = {
            u: {
                "x": ["to be or not to be, that is the question: whether 'tis nobler in the mind to s"[:80]] * count,
                "y": ["u"] * count,
            }
            for u in users
        }
        (folder / split / "all.json").write_text(
            json.dumps({"users": users, "num_samples": [count] * len(users), "user_data": data})
        )


def test_shakespeare_reads_data_cache_dir_and_names_it_when_its_files_are_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"shakespeare/train/\*.json .*data_args.data_cache_dir="):
        _load(dataset="shakespeare", data_cache_dir=str(tmp_path))
    _leaf_shakespeare(tmp_path / "shakespeare", ["alice", "bob", "carol"])
    dataset, classes = _load(dataset="shakespeare", data_cache_dir=str(tmp_path))
    train_num, test_num = dataset[0], dataset[1]
    assert (train_num, test_num, classes) == (18, 6, 90)  # its 3 users, from data_cache_dir


def test_the_offline_guard_is_this_threads_alone_and_replaces_nothing_in_socket():
    """Issue 77: the guard once replaced socket.socket.connect and socket.getaddrinfo process-wide
    while FedML's loaders ran. Now it is an audit hook that acts on the loading thread alone."""
    import socket
    import threading

    from fedml_perfedavg.fedml_bridge.data_and_models import _offline_in_this_thread

    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    functions = (socket.socket.connect, socket.getaddrinfo, socket.create_connection)
    reached = []

    def elsewhere():
        with socket.create_connection(address, timeout=5):
            reached.append(True)

    with _offline_in_this_thread(lambda where: ConfigError(f"refused {where}")):
        assert (socket.socket.connect, socket.getaddrinfo, socket.create_connection) == functions
        other = threading.Thread(target=elsewhere)
        other.start()
        other.join(10)
        with pytest.raises(ConfigError, match=r"refused \('127.0.0.1'"):
            socket.create_connection(address, timeout=5)
        with pytest.raises(ConfigError, match="refused example.org:80"):
            socket.getaddrinfo("example.org", 80)
    assert reached == [True]  # another thread connected meanwhile
    with socket.create_connection(address, timeout=5):  # and this one does again afterwards
        pass
    listener.close()


def test_a_run_that_does_not_ask_for_the_plugin_gets_fedmls_model_as_is():
    """Issue 77: FedML's own algorithm, no plugin_fixes: ``fedml.model.create`` is FedML's call,
    drawing from the global generator where FedML left it (a plugin run reseeds from random_seed)."""
    import torch

    from fedml_perfedavg.fedml_bridge.data_and_models import creating_paper_models

    def fedmls(args, output_dim):
        return torch.nn.Linear(4, output_dim)

    args = SimpleNamespace(model="lr", dataset="mnist", random_seed=0)
    torch.manual_seed(5)
    torch.rand(3)  # the data loading drew from it
    expected = fedmls(args, 2).weight
    torch.manual_seed(5)
    torch.rand(3)
    assert torch.equal(creating_paper_models(fedmls, lambda a: False)(args, 2).weight, expected)
    torch.manual_seed(5)
    torch.rand(3)
    assert not torch.equal(creating_paper_models(fedmls, lambda a: True)(args, 2).weight, expected)


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("dataset", ["shakespeare", "mnist"])
@pytest.mark.parametrize("clients, batch_size", [(4, 4), (1, 4), (4, 0)])  # centralized, full batch too
def test_leaf_loaders_give_fedmls_dataset_with_their_folders_as_arguments(
    tmp_path, monkeypatch, dataset, clients, batch_size
):
    """Issue 77: FedML's LEAF loaders are called with data_cache_dir's folders instead of FedML's
    names being swapped while they run: the same dataset and args as FedML's own path (given the
    folders by a swap here, in the test, and no download)."""
    import fedml.data.shakespeare.data_loader as shakespeare

    from fedml_perfedavg.fedml_bridge.data_and_models import leaf_loaded

    from tests.backends.test_fedml_user_input import _leaf_mnist

    _leaf_shakespeare(tmp_path / "shakespeare", ["alice", "bob", "carol"])
    _leaf_mnist(tmp_path)
    given = dict(
        client_num_in_total=clients, batch_size=batch_size, download=False, training_type="simulation", model="lr"
    )
    given.update(dataset=dataset, data_cache_dir=str(tmp_path), partition_method="hetero", partition_alpha=0.5)
    ours, theirs = SimpleNamespace(**given), SimpleNamespace(**given)
    loaded = leaf_loaded(ours)
    read = shakespeare.read_data
    folders = [str(tmp_path / "shakespeare" / split) for split in ("train", "test")]
    monkeypatch.setattr(shakespeare, "read_data", lambda train, test: read(*folders))
    monkeypatch.setattr(fedml_loader, "download_mnist", lambda data_cache_dir: None)
    expected = getattr(fedml_loader.load, "__wrapped__", fedml_loader.load)(theirs)
    assert _same(list(loaded), list(expected)) and vars(ours) == vars(theirs)
