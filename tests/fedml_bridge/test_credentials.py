"""Certificates: bounded validity, one spelling per rank, extended key usage checked, and
launch-silo's CA key never written."""

import pytest

from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.fedml_bridge.cross_silo.credentials import (
    MAX_DAYS,
    load_credentials,
    make_certificates,
    peer_certificate_problem,
    rank_of_names,
)
from fedml_perfedavg.run.certs import main as certs

from tests.helpers import certificate_from


def test_validity_is_bounded(tmp_path, capsys):
    assert certs(["--out", str(tmp_path / "a"), "--clients", "1", "--days", "100000"]) == 2
    assert f"--days 100000: must be 1..{MAX_DAYS}" in capsys.readouterr().err
    assert certs(["--out", str(tmp_path / "b"), "--clients", "1", "--days", "0"]) == 2
    assert certs(["--out", str(tmp_path / "c"), "--clients", "1", "--days", str(MAX_DAYS)]) == 0


@pytest.mark.parametrize(
    "name,rank",
    [
        ("rank-1.fedml-perfedavg", 1),
        ("rank-0.fedml-perfedavg", 0),
        ("rank-01.fedml-perfedavg", None),
        ("rank-+1.fedml-perfedavg", None),
        ("rank-00.fedml-perfedavg", None),
        ("rank-1.fedml-perfedavg.evil", None),
    ],
)
def test_a_rank_has_one_spelling(name, rank):
    assert rank_of_names([name]) == rank


def test_without_the_ca_key_nobody_can_issue_another_certificate(tmp_path):
    files = make_certificates(str(tmp_path), 2, keep_ca_key=False)
    assert not (tmp_path / "ca.key").exists() and all("ca.key" not in f for f in files)
    assert load_credentials(str(tmp_path), 2).rank == 2


def _certificate(tmp_path, usages):
    """A rank-1 certificate from a run CA of its own with the given extended key usages (None: no
    extension), beside that CA's certificate."""
    make_certificates(str(tmp_path), 1)
    return certificate_from(tmp_path, tmp_path, usages)


def test_extended_key_usage_is_checked(tmp_path):
    from cryptography.x509.oid import ExtendedKeyUsageOID

    signing = _certificate(tmp_path / "a", [ExtendedKeyUsageOID.CODE_SIGNING])
    assert "does not allow ['clientAuth']" in peer_certificate_problem(signing)
    with pytest.raises(ConfigError, match=r"rank-1.pem does not allow \['clientAuth', 'serverAuth'\]"):
        load_credentials(str(tmp_path / "a"), 1)
    client_only = _certificate(tmp_path / "b", [ExtendedKeyUsageOID.CLIENT_AUTH])
    assert peer_certificate_problem(client_only) is None  # enough to open a connection as a client
    with pytest.raises(ConfigError, match=r"does not allow \['serverAuth'\]"):
        load_credentials(str(tmp_path / "b"), 1)  # but a rank also listens
    assert peer_certificate_problem(_certificate(tmp_path / "c", None)) is None  # no extension: any use
