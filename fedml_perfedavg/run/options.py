"""The command-line options every command shares (the run, launch-silo, export-split)."""

from __future__ import annotations

import argparse


def add_config_options(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``--cf CONFIG.yaml`` and ``--set KEY=VALUE`` (repeatable): how every command takes a config."""
    parser.add_argument("--cf", "--yaml_config_file", dest="config", required=required, help="FedML-style YAML config")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set comm_round=20 (repeatable; section.key works too)",
    )
