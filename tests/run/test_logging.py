"""A script's own logging setup is respected while run.log still gets every line."""

import os
import subprocess
import sys

from tests.helpers import HF_YAML, REPO, needs_mnist

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.WARNING)  # the script wants warnings only on its console
from fedml_perfedavg.run.config import load
from fedml_perfedavg.run.runner import run
config = load(sys.argv[1], ["comm_round=2", "frequency_of_the_test=1", "show_progress=false",
                            "data_cache_dir=" + sys.argv[2]])
run(config, sys.argv[3])
logging.getLogger("after").warning("the script's warnings still show")
"""


@needs_mnist
def test_a_scripts_warning_level_is_kept_and_run_log_gets_the_info_lines(mnist_root, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, HF_YAML, mnist_root, str(run_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "INFO" not in done.stderr, done.stderr[-3000:]
    assert "the script's warnings still show" in done.stderr
    log = (run_dir / "run.log").read_text()
    assert "round 1: personalized accuracy" in log and "per-user accuracy" in log
