"""``fedml-perfedavg certs``: the keys and certificates of a cross-silo run (``comm_args.tls_dir``).

A deployment, where no party holds another's private key (docs/deployment.md)::

    certs ca --out CA_DIR                          the CA (ca.pem, ca.key): signs, never generates keys
    certs request --out DIR --rank R               an organization's own key and signing request
    certs sign --ca CA_DIR --request rank-R.csr --out DIR    the CA's certificate for a request
    certs fingerprint FILE                         a certificate's, request's or key's fingerprint
    certs roster --tls-dir DIR --clients N         the run's key roster from the certificates

One machine, one operator (tests, a demo): ``certs --out DIR --clients N`` makes everything.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, Sequence

from ..core.errors import ConfigError
from ..net.credentials import (
    CA_CERT,
    CA_KEY,
    MAX_DAYS,
    cert_file,
    key_file,
    make_ca,
    make_certificates,
    make_request,
    roster_from_certificates,
    sign_request,
)
from ..net.key_roster import ROSTER, key_fingerprint

PROG = "fedml-perfedavg certs"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Make a run CA, a TLS certificate and key per rank and the run's key roster on one machine "
        "(comm_args.tls_dir). In a deployment each organization makes its own key instead: "
        f"{PROG} ca | request | sign | fingerprint | roster (each with --help).",
        epilog=f"Hand each host {CA_CERT}, {ROSTER} and its own rank's {cert_file(0).replace('0', 'R')} and "
        f"{key_file(0).replace('0', 'R')}; keep {CA_KEY} off the training hosts.",
    )
    parser.add_argument("--out", required=True, help="folder to write into (created; must not hold certificates)")
    parser.add_argument("--clients", type=int, required=True, help="number of silos (ranks 1..N)")
    _days(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace certificates already in --out")
    return parser


def _days(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--days", type=int, default=30, help=f"validity in days, 1..{MAX_DAYS} (default 30)")


def _everything(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    files = make_certificates(args.out, args.clients, args.days, args.overwrite)
    print(
        f"wrote {len(files)} files to {args.out}: {CA_CERT}, {CA_KEY} (private), {ROSTER}, and "
        f"{cert_file(0)}/{key_file(0)} (server) to {cert_file(args.clients)}/{key_file(args.clients)}; set "
        f"comm_args.tls_dir: {args.out}. One party made every key here: in a deployment each organization makes "
        f"its own ({PROG} request)"
    )
    return 0


def _ca(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} ca", description="Make the run CA alone: it signs requests.")
    parser.add_argument("--out", required=True, help="the CA's folder (keep it off the training hosts)")
    _days(parser)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(list(argv))
    make_ca(args.out, args.days, args.overwrite)
    print(f"wrote {CA_CERT} and {CA_KEY} (private) to {args.out}; hand {CA_CERT} to every organization")
    return 0


def _request(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} request", description="An organization's own key for its rank and a signing request for the CA."
    )
    parser.add_argument("--out", required=True, help="this organization's tls folder")
    parser.add_argument("--rank", type=int, required=True, help="its rank (0 = the server)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(list(argv))
    files, fingerprint = make_request(args.out, args.rank, args.overwrite)
    print(
        f"wrote {files[0]} (private: it never leaves this host) and {files[1]} (send it to the CA); this key's "
        f"fingerprint, to publish to the other organizations: {fingerprint}"
    )
    return 0


def _sign(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} sign", description="The CA's certificate for a signing request.")
    parser.add_argument("--ca", required=True, help="the CA's folder (ca.pem, ca.key)")
    parser.add_argument("--request", required=True, help="an organization's rank-R.csr")
    parser.add_argument("--out", required=True, help="where to write rank-R.pem")
    _days(parser)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(list(argv))
    path, rank = sign_request(args.ca, args.request, args.out, args.days, args.overwrite)
    print(f"wrote {path} (rank {rank}; key fingerprint {key_fingerprint(open(path, 'rb').read())}); send it back")
    return 0


def _fingerprint(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} fingerprint", description="The SHA-256 of the public key in a certificate, request or key."
    )
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(list(argv))
    for name in args.files:
        try:
            with open(name, "rb") as stream:
                print(f"{key_fingerprint(stream.read(1 << 16))}  {name}")
        except (OSError, ValueError) as err:
            raise ConfigError(f"{name}: {err}") from None
    return 0


def _roster(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} roster",
        description="The run's key roster from every rank's certificate; each organization checks its rows against "
        "the fingerprints the organizations published before it takes part.",
    )
    parser.add_argument("--tls-dir", required=True, help="a folder with rank-0.pem .. rank-N.pem")
    parser.add_argument("--clients", type=int, required=True, help="number of silos (ranks 1..N)")
    parser.add_argument("--out", help=f"the roster file (default: --tls-dir's {ROSTER})")
    args = parser.parse_args(list(argv))
    if args.clients < 1:
        raise ConfigError(f"--clients {args.clients}: must be >= 1")
    path, keys = roster_from_certificates(args.tls_dir, args.clients + 1, args.out)
    print(f"wrote {path}:")
    for rank, fingerprint in sorted(keys.items()):
        print(f"  rank {rank}: {fingerprint}")
    return 0


COMMANDS: Dict[str, Callable[[Sequence[str]], int]] = {
    "ca": _ca,
    "request": _request,
    "sign": _sign,
    "fingerprint": _fingerprint,
    "roster": _roster,
}


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    command = COMMANDS.get(argv[0], _everything) if argv else _everything
    try:
        return command(argv[1:] if command is not _everything else argv)
    except (ConfigError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
