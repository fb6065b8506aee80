"""Every benchmark script starts: ``python benchmarks/X.py --help`` prints its usage. A script whose
imports break (opacus 1.6.0 installs a top-level package named ``benchmarks``, which shadowed
``from benchmarks.table1 import ...``) would otherwise be found broken only when a figure is due."""

import subprocess
import sys

import pytest

from tests.helpers import REPO

# One interpreter runs each script as __main__ with --help (most import torch and the plugin: one
# import for all of them).
CHECK = """
import contextlib, io, json, runpy, sys
broken = {}
for path in sys.argv[1:]:
    saved_path, out = list(sys.path), io.StringIO()
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as end:
        code = end.code
    except BaseException as err:
        code = f"{type(err).__name__}: {err}"
    sys.path[:] = saved_path
    if code not in (0, None) or "usage:" not in out.getvalue():
        broken[path] = str(code)
print(json.dumps(broken))
"""
# Runs in a venv of its own with flwr (its docstring): flwr and FedML need different protobufs.
OWN_VENV = {"secagg_flower_round.py"}


@pytest.mark.backend
def test_every_benchmark_script_starts_and_prints_its_usage():
    import json

    scripts = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name not in OWN_VENV)
    assert len(scripts) > 20
    done = subprocess.run(
        [sys.executable, "-c", CHECK, *map(str, scripts)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {}
