"""Who is who in a cross-silo run: a run CA, a certificate and key per rank, and the rank a
peer's certificate names.

Files in ``comm_args.tls_dir`` (what ``fedml-perfedavg certs --out DIR --clients N`` writes):

    ca.pem            the CA certificate: every rank needs it
    ca.key            the CA's private key: keep it off the training hosts (it issues certificates)
    rank-R.pem        rank R's certificate (0 = the server, 1..N = silos)
    rank-R.key        rank R's private key: only the host of rank R needs it
    roster.json       every rank's public key, which each rank pins (:mod:`.key_roster`): a
                      certificate the CA signs for a key not on it is refused

In a deployment each organization makes its own key and a signing request (``certs request``), the
CA signs the request (``certs sign``: it never sees a private key), and the roster lists the keys
the organizations published (``certs roster``); ``certs --out DIR --clients N`` makes everything on
one machine, for tests and a single operator.

A rank's certificate names the rank in a DNS subject alternative name ``rank-R.fedml-perfedavg``
(:func:`rank_name`); an organization's own CA works the same way when it issues certificates with
that name. Private keys are written mode 0600.
"""

from __future__ import annotations

import datetime
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..core.errors import ConfigError
from .key_roster import ROSTER, KeyRoster, key_fingerprint, read_roster, roster_path_of, write_roster

DOMAIN = "fedml-perfedavg"
# Canonical decimal only: "rank-01" or "rank-+1" name no rank (one rank, one spelling).
_RANK_NAME = re.compile(r"^rank-(0|[1-9]\d{0,5})\." + re.escape(DOMAIN) + r"$")
CA_CERT, CA_KEY = "ca.pem", "ca.key"
MAX_DAYS = 825  # the longest validity browsers ever accepted for a TLS certificate; a run's are short-lived


def rank_name(rank: int) -> str:
    """The DNS name a rank's certificate carries (and the name a sender expects of its receiver)."""
    return f"rank-{rank}.{DOMAIN}"


def rank_of_names(names: Iterable[str]) -> Optional[int]:
    """The rank named by a certificate's DNS names, or None when none (or several) name one."""
    ranks = {int(m.group(1)) for m in (_RANK_NAME.match(n) for n in names) if m}
    return ranks.pop() if len(ranks) == 1 else None


def cert_file(rank: int) -> str:
    return f"rank-{rank}.pem"


def key_file(rank: int) -> str:
    return f"rank-{rank}.key"


@dataclass(frozen=True)
class Credentials:
    """PEM bytes for one rank: the CA certificate, its own certificate and private key; the run's
    key roster it pins (None: it trusts every certificate the CA signed for a rank)."""

    rank: int
    ca: bytes
    cert: bytes
    key: bytes
    roster: Optional[KeyRoster] = None

    def peer_problem(self, rank: int, certificate: bytes) -> Optional[str]:
        """Why a peer's ``certificate`` is not rank ``rank``'s on the roster (None: it is, or no roster)."""
        return None if self.roster is None else self.roster.problem(rank, certificate)


def _write(path: str, data: bytes, private: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as stream:
        stream.write(data)
    os.chmod(path, 0o600 if private else 0o644)  # an existing file keeps its mode through O_CREAT


def _check_certificate_request(out_dir: str, clients: int, days: int, overwrite: bool, names: List[str]) -> None:
    if clients < 1:
        raise ConfigError(f"--clients {clients}: must be >= 1")
    if not 1 <= days <= MAX_DAYS:
        raise ConfigError(
            f"--days {days}: must be 1..{MAX_DAYS}; certificates of a run are replaced by making new "
            f"ones, not kept for years"
        )
    existing = [n for n in names if os.path.exists(os.path.join(out_dir, n))]
    if existing and not overwrite:
        raise ConfigError(
            f"--out {out_dir!r}: already holds {existing[:3]}; give an empty folder (or --overwrite "
            f"to replace them, which ends every run that uses the old ones)"
        )


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _ca_certificate(ca_key: Any, ca_name: Any, start: datetime.datetime, end: datetime.datetime) -> Any:
    """The run CA's self-signed certificate: it may sign certificates, one level deep."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(ca_key, hashes.SHA256())
    )


def _rank_certificate(
    rank: int, public_key: Any, ca_key: Any, ca_name: Any, start: datetime.datetime, end: datetime.datetime
) -> Any:
    """Rank ``rank``'s certificate: its name as the subject and the only DNS name, for a server
    and a client of mutual TLS alike, signed by the run CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, rank_name(rank))]))
        .issuer_name(ca_name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(rank_name(rank))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def make_certificates(
    out_dir: str, clients: int, days: int = 30, overwrite: bool = False, keep_ca_key: bool = True
) -> List[str]:
    """A new CA and a certificate and key for ranks 0..clients in ``out_dir``; returns the files.
    ``keep_ca_key=False`` never writes the CA's key (nobody can issue another certificate for
    this run: what ``launch-silo`` does)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    names = (
        [CA_CERT, *([CA_KEY] if keep_ca_key else [])]
        + [f for r in range(clients + 1) for f in (cert_file(r), key_file(r))]
        + [ROSTER]
    )
    _check_certificate_request(out_dir, clients, days, overwrite, names)
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{DOMAIN} run CA")])
    ca = _ca_certificate(ca_key, ca_name, start, end)
    _write(os.path.join(out_dir, CA_CERT), ca.public_bytes(serialization.Encoding.PEM), private=False)
    if keep_ca_key:
        _write(os.path.join(out_dir, CA_KEY), _pem_key(ca_key), private=True)
    keys = {}
    for rank in range(clients + 1):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _rank_certificate(rank, key.public_key(), ca_key, ca_name, start, end)
        pem = cert.public_bytes(serialization.Encoding.PEM)
        _write(os.path.join(out_dir, cert_file(rank)), pem, private=False)
        _write(os.path.join(out_dir, key_file(rank)), _pem_key(key), private=True)
        keys[rank] = key_fingerprint(pem)
    write_roster(os.path.join(out_dir, ROSTER), keys)
    return [os.path.join(out_dir, n) for n in names]


def make_ca(out_dir: str, days: int = 30, overwrite: bool = False) -> List[str]:
    """The run CA alone (``ca.pem``, ``ca.key``): it signs the organizations' requests (:func:`sign_request`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    _check_certificate_request(out_dir, 1, days, overwrite, [CA_CERT, CA_KEY])
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{DOMAIN} run CA")])
    ca = _ca_certificate(ca_key, ca_name, now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    _write(os.path.join(out_dir, CA_CERT), ca.public_bytes(serialization.Encoding.PEM), private=False)
    _write(os.path.join(out_dir, CA_KEY), _pem_key(ca_key), private=True)
    return [os.path.join(out_dir, CA_CERT), os.path.join(out_dir, CA_KEY)]


def request_file(rank: int) -> str:
    return f"rank-{rank}.csr"


def make_request(out_dir: str, rank: int, overwrite: bool = False) -> Tuple[List[str], str]:
    """An organization's own key for rank ``rank`` and a signing request for it (``rank-R.key``,
    mode 0600, never sent; ``rank-R.csr``, for the CA); returns the files and the key's fingerprint."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if rank < 0:
        raise ConfigError(f"--rank {rank}: must be >= 0 (0 is the server)")
    names = [key_file(rank), request_file(rank)]
    _check_certificate_request(out_dir, 1, 1, overwrite, names)
    os.makedirs(out_dir, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, rank_name(rank))]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(rank_name(rank))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(os.path.join(out_dir, key_file(rank)), _pem_key(key), private=True)
    pem = request.public_bytes(serialization.Encoding.PEM)
    _write(os.path.join(out_dir, request_file(rank)), pem, private=False)
    return [os.path.join(out_dir, n) for n in names], key_fingerprint(pem)


def sign_request(
    ca_dir: str, request_path: str, out_dir: str, days: int = 30, overwrite: bool = False
) -> Tuple[str, int]:
    """The CA's certificate (``rank-R.pem`` in ``out_dir``) for a signing request: its signature
    checked, exactly one rank named, that name alone in the certificate. Returns (file, rank)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        with open(request_path, "rb") as stream:
            request = x509.load_pem_x509_csr(stream.read(1 << 16))
    except (OSError, ValueError) as err:
        raise ConfigError(f"--request {request_path!r}: not a readable PEM signing request ({err})") from None
    if not request.is_signature_valid:
        raise ConfigError(f"--request {request_path!r}: its signature is not its key's")
    try:
        names = list(
            request.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.DNSName
            )
        )
    except x509.ExtensionNotFound:
        names = []
    rank = rank_of_names(names)
    if rank is None or len(names) != 1:
        raise ConfigError(
            f"--request {request_path!r}: names {names}; a rank's request names one rank, rank-R.{DOMAIN} "
            f"(fedml-perfedavg certs request makes one)"
        )
    ca_pem = _read(ca_dir, CA_CERT, "the CA certificate")
    ca_key = serialization.load_pem_private_key(_read(ca_dir, CA_KEY, "the CA's private key"), password=None)
    ca = x509.load_pem_x509_certificate(ca_pem)
    if not 1 <= days <= MAX_DAYS:
        raise ConfigError(f"--days {days}: must be 1..{MAX_DAYS}")
    _check_certificate_request(out_dir, 1, days, overwrite, [cert_file(rank)])
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    end = min(now + datetime.timedelta(days=days), ca.not_valid_after_utc)
    cert = _rank_certificate(rank, request.public_key(), ca_key, ca.subject, now - datetime.timedelta(minutes=5), end)
    path = os.path.join(out_dir, cert_file(rank))
    _write(path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return path, rank


def roster_from_certificates(tls_dir: str, ranks: int, out: Optional[str] = None) -> Tuple[str, Dict[int, str]]:
    """The run's key roster from ``tls_dir``'s rank-0..rank-(ranks-1) certificates, written to ``out``
    (default ``tls_dir``/roster.json). Returns the file and rank -> fingerprint."""
    keys = {}
    for rank in range(ranks):
        try:
            keys[rank] = key_fingerprint(_read(tls_dir, cert_file(rank), f"rank {rank}'s certificate"))
        except ValueError as err:
            raise ConfigError(f"{os.path.join(tls_dir, cert_file(rank))}: {err}") from None
    path = out or os.path.join(tls_dir, ROSTER)
    write_roster(path, keys)
    return path, keys


def _read(tls_dir: str, name: str, what: str) -> bytes:
    path = os.path.join(tls_dir, name)
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except OSError as err:
        raise ConfigError(
            f"comm_args.tls_dir={tls_dir!r}: cannot read {name} ({what}): {err.strerror}; make "
            f"certificates with: fedml-perfedavg certs --out {tls_dir} --clients N"
        ) from None


def load_credentials(tls_dir: str, rank: int, roster_path: Optional[str] = None) -> Credentials:
    """Rank ``rank``'s credentials from ``tls_dir``, checked: its certificate names that rank, is
    signed by the CA in the folder, is valid now, and its key is readable by its owner alone; with
    the run's key roster (``roster_path``, else ``tls_dir``'s roster.json), its own key is its row."""
    from cryptography import x509

    ca_pem = _read(tls_dir, CA_CERT, "the CA certificate")
    cert_pem = _read(tls_dir, cert_file(rank), f"rank {rank}'s certificate")
    key_path = os.path.join(tls_dir, key_file(rank))
    key_pem = _read(tls_dir, key_file(rank), f"rank {rank}'s private key")
    mode = stat.S_IMODE(os.stat(key_path).st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"comm_args.tls_dir={tls_dir!r}: {key_file(rank)} is readable by others (mode "
            f"{mode:o}); chmod 600 {key_path}"
        )
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as err:
        raise ConfigError(
            f"comm_args.tls_dir={tls_dir!r}: {CA_CERT} or {cert_file(rank)} is not a PEM certificate ({err})"
        ) from None
    names = dns_names(cert)
    named = rank_of_names(names)
    if named != rank:
        raise ConfigError(
            f"comm_args.tls_dir={tls_dir!r}: {cert_file(rank)} names rank {named} (DNS names "
            f"{names}), not rank {rank}; a rank's certificate must carry the name {rank_name(rank)}"
        )
    now = datetime.datetime.now(datetime.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(
            f"comm_args.tls_dir={tls_dir!r}: {cert_file(rank)} is valid from "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} to {cert.not_valid_after_utc:%Y-%m-%d %H:%M} "
            f"UTC, not now; make new certificates"
        )
    problem = _usage_problem(cert, need_server=True)
    if problem is not None:
        raise ConfigError(
            f"comm_args.tls_dir={tls_dir!r}: {cert_file(rank)} {problem}; every rank is a TLS server "
            f"and client, so its certificate must allow both (serverAuth and clientAuth)"
        )
    try:  # the issuer's name and signature, whatever the CA's key type
        cert.verify_directly_issued_by(ca)
    except Exception:  # noqa: BLE001 - cryptography's InvalidSignature and key-type errors alike
        raise ConfigError(
            f"comm_args.tls_dir={tls_dir!r}: {cert_file(rank)} is not signed by {CA_CERT}; the "
            f"folder must hold the run's CA certificate and this rank's certificate from it"
        ) from None
    path = roster_path_of(roster_path, tls_dir)
    roster = None if path is None else read_roster(path)
    problem = None if roster is None else roster.problem(rank, cert_pem)
    if problem is not None:
        raise ConfigError(
            f"comm_args.tls_dir={tls_dir!r}: this rank's own certificate ({cert_file(rank)}): {problem}; the "
            f"roster must list the key this organization made (fedml-perfedavg certs fingerprint {cert_file(rank)})"
        )
    return Credentials(rank=rank, ca=ca_pem, cert=cert_pem, key=key_pem, roster=roster)


def _usage_problem(cert, need_server: bool) -> Optional[str]:
    """Why ``cert`` may not authenticate a rank's connections (its extended key usage), or None.
    A certificate without the extension may be used for anything (RFC 5280)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return None
    need = {ExtendedKeyUsageOID.CLIENT_AUTH, *([ExtendedKeyUsageOID.SERVER_AUTH] if need_server else [])}
    missing = need - usages
    if missing:
        return (
            f"does not allow {sorted(u._name for u in missing)} (its extended key usage is "
            f"{sorted(u._name for u in usages)})"
        )
    return None


_PEER_USAGE: dict = {}  # PEM -> problem, for peers' certificates (a run has a handful)


def peer_certificate_problem(pem: bytes) -> Optional[str]:
    """Why a peer's certificate (PEM, as gRPC's auth context gives it) may not open a connection
    as a client, or None: its extended key usage must allow client authentication (OpenSSL leaves
    that to the application). Cached per certificate."""
    if not pem:
        return None  # no certificate: gRPC's mutual TLS already refused it, or the transport is insecure
    if pem not in _PEER_USAGE:
        from cryptography import x509

        try:
            problem = _usage_problem(x509.load_pem_x509_certificate(pem), need_server=False)
        except ValueError as err:
            problem = f"cannot be read ({err})"
        if len(_PEER_USAGE) > 1024:
            _PEER_USAGE.clear()
        _PEER_USAGE[pem] = problem
    return _PEER_USAGE[pem]


def check_security(tls_dir: Optional[str], insecure: bool) -> None:
    """A cross-silo process needs ``comm_args.tls_dir`` or an explicit ``comm_args.insecure``."""
    if tls_dir and insecure:
        raise ConfigError(f"comm_args.tls_dir={tls_dir!r} and comm_args.insecure=True: give one")
    if not tls_dir and not insecure:
        raise ConfigError(
            "comm_args.tls_dir=None: a cross-silo process does not start without TLS; give "
            "comm_args.tls_dir (make certificates with: fedml-perfedavg certs --out DIR --clients N), "
            "or set comm_args.insecure: true for plaintext without authentication on a network you "
            "trust"
        )


def dns_names(cert: Any) -> List[str]:
    """The DNS subject alternative names of a certificate (``cryptography``'s x509 object)."""
    from cryptography import x509

    try:
        return list(
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        )
    except x509.ExtensionNotFound:
        return []


def certificate_rank_problem(pem: bytes, ca_pem: bytes, rank: int) -> Optional[str]:
    """Why ``pem`` is not a certificate the run's CA (``ca_pem``) issued to ``rank`` and that is
    valid now, or None: what a silo checks of another silo's certificate that the server relays
    with its secure-aggregation keys (the server could otherwise put its own keys in a silo's name)."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert = x509.load_pem_x509_certificate(pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as err:
        return f"its certificate is not one the run's CA issued ({type(err).__name__}: {str(err)[:120]})"
    now = datetime.datetime.now(datetime.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        return "its certificate is not valid now"
    names = dns_names(cert)
    named = rank_of_names(names)
    if named != rank:
        return f"its certificate names rank {named}, not rank {rank}"
    return None
