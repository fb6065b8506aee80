"""Certificates: bounded validity, one spelling per rank, extended key usage checked, and
launch-silo's CA key never written."""

import pytest

from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.net.credentials import (
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


def _sign(ca, request, out):
    """``fedml-perfedavg certs sign``: the CA's certificate for ``request``, written to ``out``."""
    return certs(["sign", "--ca", str(ca), "--request", str(request), "--out", str(out)])


def test_each_organization_makes_its_own_key_and_the_roster_pins_it(tmp_path, capsys):
    """Issue 75, rule 3: the CA signs requests and never sees a private key; the roster lists the
    keys the organizations made, and a rank whose certificate the CA signed for another key (what
    the holder of ca.key can make) does not start."""
    import json
    import os
    import shutil

    from fedml_perfedavg.net.key_roster import key_fingerprint

    assert certs(["ca", "--out", str(tmp_path / "ca")]) == 0
    published = {}
    for rank in (0, 1, 2):
        org = tmp_path / f"org{rank}"
        assert certs(["request", "--out", str(org), "--rank", str(rank)]) == 0
        published[rank] = capsys.readouterr().out.rsplit(" ", 1)[-1].strip()  # the fingerprint it publishes
        assert _sign(tmp_path / "ca", org / f"rank-{rank}.csr", org) == 0
        shutil.copy(tmp_path / "ca" / "ca.pem", org)
    assert sorted(os.listdir(tmp_path / "ca")) == ["ca.key", "ca.pem"]  # no organization's key ever was there
    collected = tmp_path / "collected"
    collected.mkdir()
    for rank in (0, 1, 2):
        shutil.copy(tmp_path / f"org{rank}" / f"rank-{rank}.pem", collected)
    assert certs(["roster", "--tls-dir", str(collected), "--clients", "2"]) == 0
    roster = json.loads((collected / "roster.json").read_text())
    assert roster["ranks"] == {str(r): f for r, f in published.items()}  # what each organization checks
    for rank in (0, 1, 2):
        shutil.copy(collected / "roster.json", tmp_path / f"org{rank}")
        credentials = load_credentials(str(tmp_path / f"org{rank}"), rank)
        assert credentials.roster is not None and credentials.peer_problem(rank, credentials.cert) is None
    # the holder of ca.key signs a request of its own for rank 2: a valid certificate, not on the roster
    assert certs(["request", "--out", str(tmp_path / "minted"), "--rank", "2"]) == 0
    assert _sign(tmp_path / "ca", tmp_path / "minted" / "rank-2.csr", tmp_path / "minted") == 0
    minted = (tmp_path / "minted" / "rank-2.pem").read_bytes()
    honest = load_credentials(str(tmp_path / "org1"), 1)
    assert "not rank 2's on the run's key roster" in honest.peer_problem(2, minted)
    assert key_fingerprint(minted) != published[2]
    shutil.copy(tmp_path / "minted" / "rank-2.pem", tmp_path / "org2")
    shutil.copy(tmp_path / "minted" / "rank-2.key", tmp_path / "org2")
    with pytest.raises(ConfigError, match=r"this rank's own certificate \(rank-2.pem\): .*outside the roster"):
        load_credentials(str(tmp_path / "org2"), 2)
    # a file that is not a signing request is not signed
    capsys.readouterr()
    assert _sign(tmp_path / "ca", tmp_path / "org1" / "rank-1.key", tmp_path / "x") == 2
    assert "not a readable PEM signing request" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,words",
    [
        ('{"format": "other", "ranks": {}}', "its format"),
        (
            '{"format": "fedml-perfedavg key roster, version 1", "ranks": {"01": "' + "a" * 64 + '"}}',
            "'01' is not a rank",
        ),
        ('{"format": "fedml-perfedavg key roster, version 1", "ranks": {"0": "xyz"}}', "not a SHA-256 fingerprint"),
        (
            '{"format": "fedml-perfedavg key roster, version 1", "ranks": {"0": "'
            + "a" * 64
            + '", "1": "'
            + "a" * 64
            + '"}}',
            "one key is listed for two ranks",
        ),
        ("NaN", "not a number JSON allows"),
        ("[" * 100000 + "]" * 100000, "nested deeper than the parser goes"),
    ],
)
def test_a_damaged_roster_is_refused_naming_the_file_and_the_fault(tmp_path, text, words):
    from fedml_perfedavg.net.key_roster import read_roster

    path = tmp_path / "roster.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"comm_args.roster_path='{path}': not the run's key roster \(.*{words}"):
        read_roster(str(path))
