"""Data-owner cross-silo (``comm_args.silo_data: own``): what each process loads, and
``fedml-perfedavg export-split``, which cuts a config's split into one folder per organization.

    fedml-perfedavg export-split --cf CONFIG.yaml --out DIR [--set KEY=VALUE ...]

writes ``DIR/rank-R/`` for R = 1..n (user R-1's train and test data, see
:mod:`fedml_perfedavg.data.silo_folder`); silo R then runs with
``--set silo_data=own --set data_cache_dir=DIR/rank-R`` and reads that folder and no other file.
The server reads no data at all: its model comes from ``model_args`` and the dataset's name.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Dict, Optional, Sequence

from ..core.errors import ConfigError
from ..data.loading import DATASETS, FederatedData
from ..data.partition import PARTITIONS
from ..data.silo_folder import SPLIT_KEYS, check_split, export_users, is_export, is_silo_folder, read_silo_folder
from .options import add_config_options
from .config import load
from .schema import Config

logger = logging.getLogger(__name__)

# Classes of FedML's own datasets (fedml/data/data_loader.py), for a server that reads no data.
FEDML_CLASSES = {
    "femnist": 62,
    "fed_cifar100": 100,
    "cifar100": 100,
    "cinic10": 10,
    "svhn": 10,
    "fed_shakespeare": 90,
    "shakespeare": 90,  # fedml/data/shakespeare: VOCAB_SIZE (86 letters + 4), as its RNN_OriginalFedAvg
    "stackoverflow_lr": 500,
    "stackoverflow_nwp": 10004,
}


def split_keys(config: Config) -> Dict[str, Any]:
    """The config's values that define its split (recorded in each exported folder)."""
    return {key: config.setting(key) for key in SPLIT_KEYS}


def server_data(config: Config) -> FederatedData:
    """The server's dataset in data-owner mode: no users, the dataset's number of classes."""
    spec = DATASETS.get(config.data.dataset)
    if spec is not None:
        return FederatedData([], spec.num_classes, spec.input_shape, [])
    if config.data.dataset in FEDML_CLASSES:
        return FederatedData([], FEDML_CLASSES[config.data.dataset], (), [])
    raise ConfigError(
        f"data_args.dataset={config.data.dataset!r}: with comm_args.silo_data='own' the server reads no data, "
        f"so it must know the dataset's number of classes to build the model; it knows "
        f"{sorted([*DATASETS, *FEDML_CLASSES])}. For another dataset, run your own main script: build the "
        f"model yourself and hand FedMLRunner an empty dataset on the server"
    )


def own_split(config: Config, rank: int, whole_split) -> Optional[FederatedData]:
    """What a process of a data-owner run loads: nothing for the server; for silo ``rank`` its
    own folder (``data_cache_dir`` from export-split), or its user of the paper's split read from
    the whole dataset (``whole_split(config)``; a warning says so); None: FedML's own loader, of
    which the run keeps the silo's client."""
    if rank == 0:
        return server_data(config)
    folder = config.data.data_cache_dir
    if is_silo_folder(folder):
        silo = read_silo_folder(folder)
        if silo.rank != rank:
            raise ConfigError(
                f"data_args.data_cache_dir={folder!r} holds rank {silo.rank}'s data (user {silo.user_id}); "
                f"this is rank {rank}: give it its own folder, DIR/rank-{rank}"
            )
        if silo.dataset != config.data.dataset:
            raise ConfigError(
                f"data_args.data_cache_dir={folder!r} holds {silo.dataset!r} data; this run has "
                f"data_args.dataset={config.data.dataset!r}"
            )
        check_split(silo, split_keys(config), folder)
        logger.info(
            "silo rank %d: user %d's data from %s (%d training, %d test samples)",
            rank,
            silo.user_id,
            folder,
            len(silo.user.train_y),
            len(silo.user.test_y),
        )
        return FederatedData([silo.user], silo.num_classes, silo.input_shape, [silo.user_id])
    if is_export(folder):
        raise ConfigError(
            f"data_args.data_cache_dir={folder!r} is a whole export (rank-1/, rank-2/, ...); give silo "
            f"rank {rank} its own folder: data_cache_dir={os.path.join(folder, f'rank-{rank}')}"
        )
    if config.data.partition_method in PARTITIONS:
        logger.warning(
            "silo rank %d reads the whole %s dataset under %s to take user %d's part of the split; in a "
            "deployment each organization holds its own folder (fedml-perfedavg export-split)",
            rank,
            config.data.dataset,
            folder,
            rank - 1,
        )
        data = whole_split(config)
        return FederatedData([data.users[rank - 1]], data.num_classes, data.input_shape, [rank - 1])
    return None


def export_split(config: Config, out_dir: str, whole_split) -> list:
    """One folder per user of the config's split: ``out_dir/rank-R/`` for R = 1..n."""
    if config.data.partition_method not in PARTITIONS:
        raise ConfigError(
            f"data_args.partition_method={config.data.partition_method!r}: export-split cuts the paper's "
            f"split ({list(PARTITIONS)}); FedML's own loaders read each organization's data where it is"
        )
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"--out {out_dir!r}: not empty; give a new folder")
    data = whole_split(config)
    return export_users(out_dir, data.users, config.data.dataset, data.num_classes, split_keys(config))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedml-perfedavg export-split",
        description="Write one folder per user "
        "of a config's split (DIR/rank-R/ for silo rank R, user R-1), for data-owner "
        "cross-silo runs (comm_args.silo_data: own).",
    )
    add_config_options(parser)
    parser.add_argument("--out", required=True, help="a new folder to write into")
    return parser


def whole_split(config: Config) -> FederatedData:
    """The config's whole split, read from its dataset (what export-split cuts)."""
    from ..data.loading import load_federated

    return load_federated(
        config.data.dataset,
        config.data.data_cache_dir,
        config.train.client_num_in_total,
        config.data.partition_method,
        config.common.random_seed,
        download=config.data.download,
        images_per_class=config.data.images_per_class,
        test_images_per_class=config.data.test_images_per_class,
    )


SPLIT_ONLY = ("training_type=simulation", "backend=sp", "silo_data=shared")


def main(argv: Sequence[str]) -> int:
    from .. import logs

    args = build_parser().parse_args(list(argv))
    with logs.as_found_afterwards():
        logs.use_console("INFO")
        return _export(args)


def _export(args: argparse.Namespace) -> int:
    try:
        # An export reads the split's keys alone (SPLIT_KEYS): the cross-silo YAML's transport rules
        # (TLS, the address file) are for the hosts that run, not for the trusted machine.
        config = load(args.config, [*args.overrides, *SPLIT_ONLY])
        folders = export_split(config, args.out, whole_split)
    except (ConfigError, FileNotFoundError) as err:
        print(f"fedml-perfedavg export-split: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"fedml-perfedavg export-split: error: cannot write {args.out}: {err.strerror}", file=sys.stderr)
        return 1
    print(
        f"wrote {len(folders)} folders to {args.out} (rank-1 .. rank-{len(folders)}); hand each organization its "
        f"own and run its silo with --set silo_data=own --set data_cache_dir=<its folder>"
    )
    return 0
