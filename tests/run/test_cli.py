"""The command line: clean errors, usage, and --describe-data."""
import subprocess
import sys

from fedml_perfedavg.run.cli import main

from tests.helpers import REPO, needs_mnist

CONFIGS = sorted((REPO / "yaml_configs").glob("*.yaml"))


def test_cli_reports_config_errors_without_a_traceback(capsys, tmp_path):
    assert main(["--cf", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["--set", "alpha=0"]) == 2
    err = capsys.readouterr().err
    assert "--cf CONFIG.yaml is required" in err and "usage: fedml-perfedavg" in err
    assert main(["--cf", str(CONFIGS[0]), "--set", "alpha=0"]) == 2
    assert "train_args.alpha=0: must be > 0" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "no config.yaml there; is it a run directory" in capsys.readouterr().err


@needs_mnist
def test_describe_data_prints_the_paper_counts(mnist_root):
    out = subprocess.run([sys.executable, "-m", "fedml_perfedavg", "--cf", str(CONFIGS[-1]), "--describe-data",
                          "--set", f"data_cache_dir={mnist_root}"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[2].split()[:3] == ["0", "980", "160"]
    assert lines[2 + 25].split()[:3] == ["25", "490", "80"]
    assert len(lines) == 2 + 50
