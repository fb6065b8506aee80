"""docs/fedml.md's CUDA set-up: `make setup TORCH_INDEX=<index>` installs torch 2.13.0 with that
index beside pip's own, and still names torch's exact version (never a newer build)."""

import shutil
import subprocess

import pytest

from tests.helpers import REPO


@pytest.mark.backend  # runs make (dry run: nothing is installed)
@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_setup_passes_the_torch_index_to_pip():
    index = "https://download.pytorch.org/whl/cu128"
    dry = subprocess.run(
        ["make", "-n", "-B", ".venv/.installed", f"TORCH_INDEX={index}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    (install,) = [line for line in dry.stdout.splitlines() if "torch==" in line]
    assert f"--extra-index-url {index} torch==2.13.0" in install and "-c constraints.txt" in install
    plain = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=REPO, capture_output=True, text=True)
    assert "--extra-index-url" not in plain.stdout  # unset: pip's own configuration decides
    assert "make setup TORCH_INDEX=" in (REPO / "docs" / "fedml.md").read_text()
