"""``fedml-perfedavg certs --out DIR --clients N``: a run CA and a certificate and key for every
rank of a cross-silo run (0 = the server, 1..N = silos), for ``comm_args.tls_dir``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..core.errors import ConfigError
from ..fedml_bridge.cross_silo.credentials import CA_CERT, CA_KEY, MAX_DAYS, cert_file, key_file, make_certificates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedml-perfedavg certs",
        description="Make a run CA and a TLS certificate and key per rank for a cross-silo run (comm_args.tls_dir).",
        epilog=f"Hand each host {CA_CERT} and its own rank's {cert_file(0).replace('0', 'R')} and "
        f"{key_file(0).replace('0', 'R')}; keep {CA_KEY} off the training hosts.",
    )
    parser.add_argument("--out", required=True, help="folder to write into (created; must not hold certificates)")
    parser.add_argument("--clients", type=int, required=True, help="number of silos (ranks 1..N)")
    parser.add_argument("--days", type=int, default=30, help=f"validity in days, 1..{MAX_DAYS} (default 30)")
    parser.add_argument("--overwrite", action="store_true", help="replace certificates already in --out")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        files = make_certificates(args.out, args.clients, args.days, args.overwrite)
    except (ConfigError, OSError) as err:
        print(f"fedml-perfedavg certs: error: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {len(files)} files to {args.out}: {CA_CERT}, {CA_KEY} (private), and {cert_file(0)}/{key_file(0)} "
        f"(server) to {cert_file(args.clients)}/{key_file(args.clients)}; set comm_args.tls_dir: {args.out}"
    )
    return 0
