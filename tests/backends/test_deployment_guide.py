"""docs/deployment.md run as written: four organizations, each a host of its own (a network
namespace, with a mount namespace that hides everything but its own folder), plus the server's
and a trusted machine's. The only change to the guide's commands: 3 rounds instead of the YAML's
1000. The run gives the single-process model, and each organization keeps its record."""

import json
import re
import shlex
import shutil
import subprocess
import sys
import os

import torch

from fedml_perfedavg.run.config import load_yaml, resolve
from fedml_perfedavg.run.runner import run

from tests.backends.test_silo_hosts import _make_hosts, _remove_hosts, needs_netns
from tests.helpers import REPO, SILO_YAML, finish_all, needs_mnist

GUIDE = REPO / "docs" / "deployment.md"
ORGANIZATIONS = 4
ROUNDS = ["--set", "comm_round=3"]


def guide_blocks():
    """({host: [command, ...]} from the guide's ``sh`` blocks (``# on: HOST`` first), the address
    file from its ``csv`` block)."""
    text = GUIDE.read_text()
    commands = {}
    for body in re.findall(r"```sh\n(.*?)```", text, re.S):
        lines = body.replace("\\\n", " ").splitlines()
        host = lines[0].removeprefix("# on: ").strip()
        commands[host] = [line for line in lines[1:] if line.strip() and not line.startswith("#")]
    (csv,) = re.findall(r"```csv\n(.*?)```", text, re.S)
    return commands, csv


def _plugin(command: str, **replace) -> list:
    for old, new in replace.items():
        command = command.replace(old, new)
    words = shlex.split(command)
    assert words[0] == "fedml-perfedavg", command
    return [sys.executable, "-m", "fedml_perfedavg", *words[1:]]


def test_the_guide_names_the_silo_yaml_the_ports_the_even_rule_and_what_each_party_keeps():
    commands, csv = guide_blocks()
    assert set(commands) == {
        "trusted machine",
        "each party",
        "trusted machine, with the requests",
        "server",
        "organization R",
    }
    assert csv.splitlines()[0] == "eid,rank,grpc_server_ip,grpc_server_port" and len(csv.splitlines()) == 6
    text = GUIDE.read_text()
    for needed in (
        "mnist_tau10_alpha0.01_hf_silo.yaml",
        "Ports to open",
        "even number of organizations",
        "What each party keeps",
        "personalized.pt",
        "need not exist",
    ):
        assert needed in text, needed


@needs_mnist
@needs_netns
def test_four_organizations_follow_the_guide_and_each_keeps_its_record(tmp_path, mnist_root):
    commands, csv = guide_blocks()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "data").symlink_to(mnist_root)
    (trusted / "yaml_configs").symlink_to(REPO / "yaml_configs")

    def step(host, cwd, **replace):
        outs = []
        for command in commands[host]:
            out = subprocess.run(
                _plugin(command, **replace), cwd=cwd, env=env, capture_output=True, text=True, timeout=300
            )
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            outs.append(out.stdout)
        return outs

    step("trusted machine", trusted)
    homes, published = {}, {}
    (trusted / "requests").mkdir()
    for rank in range(ORGANIZATIONS + 1):  # each party makes its own key; its request goes to the CA
        home = homes[rank] = tmp_path / f"host-{rank}"
        home.mkdir()
        (printed,) = step("each party", home, **{"--rank R": f"--rank {rank}"})
        published[rank] = printed.split()[-1]
        shutil.copy2(home / "tls" / f"rank-{rank}.csr", trusted / "requests")
    sign, make_roster = commands["trusted machine, with the requests"]
    for rank in range(ORGANIZATIONS + 1):  # the CA signs each request, then writes the roster
        out = subprocess.run(_plugin(sign, **{"rank-R": f"rank-{rank}"}), cwd=trusted, env=env, capture_output=True)
        assert out.returncode == 0, out.stderr[-3000:]
    out = subprocess.run(_plugin(make_roster), cwd=trusted, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    roster = json.loads((trusted / "signed" / "roster.json").read_text())
    assert roster["ranks"] == {str(r): f for r, f in published.items()}  # what each party checks
    assert sorted(os.listdir(trusted / "ca")) == ["ca.key", "ca.pem"]  # the CA never held a party's key
    for rank in range(ORGANIZATIONS + 1):  # step 3: each machine gets its files and nothing else
        home = homes[rank]
        shutil.copy2(SILO_YAML, home)
        (home / "ipconfig.csv").write_text(csv)
        shutil.copy2(trusted / "ca" / "ca.pem", home / "tls")
        for name in ("roster.json", f"rank-{rank}.pem"):
            shutil.copy2(trusted / "signed" / name, home / "tls" / name)
        if rank:
            shutil.copytree(trusted / "export" / f"rank-{rank}", home / f"rank-{rank}")
    names, _ = _make_hosts(ORGANIZATIONS)
    processes = {}
    try:
        for rank in range(ORGANIZATIONS + 1):
            hidden = [trusted, mnist_root, *(homes[r] for r in homes if r != rank)]
            hide = "mount --make-rprivate / && " + "".join(f"mount -t tmpfs none {p} && " for p in hidden)
            entry = ["ip", "netns", "exec", names[rank], "unshare", "-m", "sh", "-c", hide + 'cd "$0" && exec "$@"']
            (command,) = commands["server" if rank == 0 else "organization R"]
            words = _plugin(command, **({"rank-R": f"rank-{rank}", "--rank R": f"--rank {rank}"} if rank else {}))
            processes[rank] = subprocess.Popen(
                [*entry, str(homes[rank]), *words, *ROUNDS],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        outs = finish_all(processes)
    finally:
        _remove_hosts(names)
    summary = json.loads((homes[0] / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    assert not (homes[0] / "data").exists()  # the server's data_cache_dir was never there
    config = resolve(
        load_yaml(str(SILO_YAML)),
        {
            "training_type": "simulation",
            "backend": "sp",
            "client_num_in_total": ORGANIZATIONS,
            "client_num_per_round": 2,
            "comm_round": 3,
            "data_cache_dir": mnist_root,
        },
    )
    sp = run(config, str(tmp_path / "sp"))
    model = torch.load(homes[0] / "run" / "model.pt", weights_only=True)
    assert all(float((model[k] - v).abs().max()) <= 1e-6 for k, v in sp.final_state.items())
    assert summary["per_user_accuracy"] == sp.summary["per_user_accuracy"]
    for rank in range(1, ORGANIZATIONS + 1):
        assert f"gRPC rank {rank} listening on 198.18.{rank}.2" in outs[rank], outs[rank][-3000:]
        own = homes[rank] / "run" / f"silo-rank-{rank}"
        record = json.loads((own / "summary.json").read_text())
        assert record["status"] == "finished" and record["user"] == rank - 1
        assert record["personalized_accuracy"] == sp.summary["per_user_accuracy"][rank - 1]
        assert (own / "model.pt").exists() and (own / "personalized.pt").exists()
        assert not (homes[rank] / "run" / "summary.json").exists()  # the run's record is the server's
