"""Issue 77: a FedML user imports one plugin to get one algorithm; FedML's own algorithms in the same
process keep FedML's transport and MPI loop unless their YAML asks for the plugin's fixes
(common_args.plugin_fixes). Each check in a fresh interpreter: another test's opt-in stays in its own."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, offline

pytestmark = pytest.mark.backend  # a fresh interpreter

PROBE = """
import json, sys
import fedml_perfedavg, fedml  # the one import, then FedML (installs the plugin)
import fedml.simulation.mpi.fedavg.FedAvgAPI as mpi_api
import fedml.core.distributed.communication.grpc.grpc_comm_manager as fedml_grpc
from fedml.core.distributed.fedml_comm_manager import FedMLCommManager
from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager
import importlib
install = importlib.import_module('fedml_perfedavg.fedml_bridge.install')

def state():
    return {
        "grpc": fedml_grpc.GRPCCommManager.__module__,
        "init_manager": hasattr(FedMLCommManager._init_manager, "__wrapped__"),
        "one_round": hasattr(mpi_api.FedAVGClientManager.handle_message_init, "__wrapped__"),
        "receive_loop": MpiCommunicationManager.handle_receive_message.__module__,
        "excepthook": sys.excepthook is sys.__excepthook__,
    }

before = state()
install.apply_to_fedml_algorithms()  # what common_args.plugin_fixes: true does in fedml.init
print(json.dumps({"before": before, "after": state(), "installed": install.is_installed()}))
"""


def test_fedmls_own_transport_and_mpi_loop_stay_fedmls_unless_the_user_asks_for_the_plugins():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["installed"]
    assert seen["before"] == {
        "grpc": "fedml.core.distributed.communication.grpc.grpc_comm_manager",
        "init_manager": False,
        "one_round": False,
        "receive_loop": "fedml.core.distributed.communication.mpi.com_manager",
        "excepthook": True,  # only a plugin run wraps it (a run stopped by a signal ends by it)
    }, seen
    assert seen["after"] == {
        "grpc": "fedml_perfedavg.fedml_bridge.cross_silo.transport",
        "init_manager": True,
        "one_round": True,
        "receive_loop": "fedml_perfedavg.fedml_bridge.mpi",
        "excepthook": True,
    }, seen


FEDAVG_YAML = """
common_args: {training_type: simulation, random_seed: 0, using_mlops: false}
data_args: {dataset: synthetic, data_cache_dir: ./data, partition_method: hetero, partition_alpha: 0.5}
model_args: {model: lr}
train_args: {federated_optimizer: FedAvg, client_num_in_total: 4, client_num_per_round: 2, comm_round: 3,
             epochs: 1, batch_size: 8, client_optimizer: sgd, learning_rate: 0.05, weight_decay: 0.0}
validation_args: {frequency_of_the_test: 1}
device_args: {using_gpu: false}
comm_args: {backend: sp}
tracking_args: {enable_wandb: false}
"""

FEDAVG_MAIN = """
import hashlib, json, os, sys, types
import torch
OUT, YAML = sys.argv[2], sys.argv[3]
if sys.argv[1] == "with":
    import fedml_perfedavg  # noqa: F401  the one import
import fedml
sys.argv = [sys.argv[0], "--cf", YAML, *sys.argv[4:]]  # cross-silo: --rank R --role ROLE --run_id ID
args = fedml.init()
torch.manual_seed(0)
def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 20, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, n, 8)]
train = {c: batches(32, c) for c in range(4)}
test = {c: batches(16, 100 + c) for c in range(4)}
dataset = [128, 64, sum(train.values(), []), sum(test.values(), []), {c: 32 for c in range(4)}, train, test, 3]
model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
def digest_of(model):
    return hashlib.sha256(b"".join(v.detach().numpy().tobytes() for v in model.state_dict().values())).hexdigest()
initial = digest_of(model)
fedml.FedMLRunner(args, fedml.device.get_device(args), dataset, model).run()

def describe(value):
    code = getattr(value, "__code__", None)
    if isinstance(value, (types.FunctionType, types.MethodType)) and code is not None:
        folder, file = os.path.split(code.co_filename)
        return os.path.basename(folder) + "/" + file + ":" + code.co_name
    if isinstance(value, type) or callable(value):
        return str(getattr(value, "__module__", "?")) + "." + str(getattr(value, "__qualname__", type(value).__name__))
    return type(value).__module__ + "." + type(value).__name__

objects = {}
for name, module in sorted(sys.modules.items()):
    if module is None or name.split(".")[0] != "fedml":
        continue
    for attribute, value in list(vars(module).items()):
        objects[name + ":" + attribute] = describe(value)
        if isinstance(value, type) and value.__module__ == name:
            for member, inner in list(vars(value).items()):
                objects[name + ":" + attribute + "." + member] = describe(inner)
digest = digest_of(model)
rank = int(getattr(args, "process_id", 0) or 0)  # MPI: each rank writes its own (rank 0 holds the global model)
with open(OUT if rank == 0 else f"{OUT}.{rank}", "w") as stream:
    json.dump({"model": digest, "initial": initial, "objects": objects}, stream)
"""

# The plugin's one install point (fedml_bridge/install.py; docs/fedml.md lists each): FedML's entry
# points learn the plugin's algorithms; each passes FedML's own algorithms through unchanged.
INSTALL_POINTS = {"fedml:init", "fedml.data:load", "fedml.model:create", "fedml.runner:FedMLRunner.__init__"}


CROSS_SILO_DRIVER = """
import socket, subprocess, sys, time
main, way, out, yaml, port, logs = sys.argv[1:7]
def start(rank):
    role = "server" if rank == 0 else "client"
    command = [sys.executable, main, way, out, yaml, "--rank", str(rank), "--role", role, "--run_id", way]
    return subprocess.Popen(command, stdout=open(f"{logs}-{rank}.log", "w"), stderr=subprocess.STDOUT)
processes = [start(0)]
deadline = time.monotonic() + 120
while True:  # FedML's client dies on a server not yet listening
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", int(port))) == 0:
            break
    if processes[0].poll() is not None or time.monotonic() > deadline:
        sys.exit(f"the server did not listen (exit {processes[0].poll()})")
    time.sleep(0.2)
processes += [start(1), start(2)]
codes = [p.wait(timeout=240) for p in processes]
sys.exit(0 if codes == [0, 0, 0] else f"exit codes {codes}")
"""


def _cross_silo(tmp_path, way, yaml, env):
    """FedML's own cross-silo FedAvg over its own gRPC transport: its server, then its two clients
    once the server listens, all in one network namespace with only loopback (FedML's own
    ``fedml.init`` posts to its cloud: here it meets no network)."""
    from fedml_perfedavg.net.addresses import read_ipconfig

    port = read_ipconfig(str(tmp_path / "ip.csv"))[0][1]
    (tmp_path / "driver.py").write_text(CROSS_SILO_DRIVER)
    main, out, logs = str(tmp_path / "main.py"), str(tmp_path / f"{way}.json"), str(tmp_path / way)
    command = [sys.executable, str(tmp_path / "driver.py"), main, way, out, yaml, str(port), logs]
    done = subprocess.run(offline(command), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=400)
    tails = "".join(
        (tmp_path / f"{way}-{r}.log").read_text()[-1500:] for r in range(3) if (tmp_path / f"{way}-{r}.log").exists()
    )
    assert done.returncode == 0, done.stderr[-2000:] + tails


@pytest.mark.parametrize("backend", ["sp", "MPI", "cross-silo"])
def test_fedmls_own_fedavg_gives_the_same_model_and_meets_the_same_fedml_with_the_plugin_imported(tmp_path, backend):
    """Issue 77: FedML's own FedAvg (sp; MPI with a server and two clients under ``mpirun``; cross-silo,
    a server and two clients over FedML's own gRPC transport) in a user's program, with ``import
    fedml_perfedavg`` and without: the same trained model bit for bit,
    and every attribute of FedML's modules (and of their classes) the same object in every process,
    but for the install points. Offline: no network here either way."""
    yaml = FEDAVG_YAML
    command = [sys.executable]
    if backend == "MPI":
        from tests.backends.test_fedml_entry_points import MPIRUN

        if MPIRUN is None:
            pytest.skip("no mpirun")
        yaml = yaml.replace("comm_args: {backend: sp}", "comm_args: {backend: MPI}").replace(
            "device_args: {using_gpu: false}",
            "device_args: {using_gpu: false, gpu_mapping_file: null, gpu_mapping_key: null}",
        )
        command = [MPIRUN, "-n", "3", sys.executable]
    if backend == "cross-silo":  # FedML's own gRPC transport: the plugin's is only for its runs (or plugin_fixes)
        from fedml_perfedavg.net.addresses import free_ports, write_ipconfig

        write_ipconfig(str(tmp_path / "ip.csv"), 3, ports=free_ports(3))
        yaml = (
            yaml.replace("training_type: simulation", "training_type: cross_silo")
            .replace(
                "client_num_in_total: 4, client_num_per_round: 2", "client_num_in_total: 2, client_num_per_round: 2"
            )
            .replace("comm_args: {backend: sp}", "comm_args: {backend: GRPC, grpc_ipconfig_path: ./ip.csv}")
        )
    (tmp_path / "fedavg.yaml").write_text(yaml)
    (tmp_path / "main.py").write_text(FEDAVG_MAIN)
    seen = {}
    for way in ("with", "without"):
        out = tmp_path / f"{way}.json"
        env = {**__import__("os").environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / f"home-{way}")}
        if backend == "cross-silo":
            _cross_silo(tmp_path, way, str(tmp_path / "fedavg.yaml"), env)
        else:
            done = subprocess.run(  # offline: FedML's own init posts to its cloud
                offline([*command, str(tmp_path / "main.py"), way, str(out), str(tmp_path / "fedavg.yaml")]),
                capture_output=True,
                text=True,
                cwd=tmp_path,
                env=env,
                timeout=300,
            )
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        ranks = ["", ".1", ".2"] if backend != "sp" else [""]
        seen[way] = [json.loads((tmp_path / f"{way}.json{rank}").read_text()) for rank in ranks]
    server_with, server_without = seen["with"][0], seen["without"][0]
    assert server_with["model"] == server_without["model"] != server_with["initial"]  # trained, the same bits
    for with_, without in zip(seen["with"], seen["without"]):
        a, b = with_["objects"], without["objects"]
        both = {k.split(":")[0] for k in a} & {k.split(":")[0] for k in b}
        changed = {k for k in set(a) | set(b) if k.split(":")[0] in both and a.get(k) != b.get(k)}
        # a submodule loaded on one side only (the plugin imports some of FedML's MPI modules) is an
        # attribute of its package there: not a change to FedML
        changed = {k for k in changed if {a.get(k), b.get(k)} - {None} != {"builtins.module"}}
        assert changed == INSTALL_POINTS, sorted(changed)


def test_every_algorithm_name_fedml_dispatches_on_is_one_of_fedmls_own_to_the_plugin():
    """A name FedML runs must never meet the plugin's "neither a plugin algorithm nor FedML's"
    error (turbo_aggregate and base_framework did, spelled otherwise in the list): every
    ``federated_optimizer`` FedML 0.9.6 compares against, read from its source."""
    import importlib.util
    import re
    from pathlib import Path

    from fedml_perfedavg.algorithms.registry import FEDML_OWN

    root = Path(importlib.util.find_spec("fedml").origin).parent
    sources = [path.read_text(errors="replace") for path in root.rglob("*.py")]
    constants = dict(re.findall(r'(FedML_FEDERATED_OPTIMIZER_\w+) = "(\w+)"', "".join(sources)))
    compared = set()
    for text in sources:
        for line in text.splitlines():
            if re.search(r"federated_optimizer\s*(==|!=|in)\s", line):
                compared |= set(re.findall(r'"(\w+)"', line))
                compared |= {constants[name] for name in re.findall(r"FedML_FEDERATED_OPTIMIZER_\w+", line)}
    assert {"FedAvg", "turbo_aggregate", "base_framework"} <= compared  # the reading finds them
    assert sorted(compared - set(FEDML_OWN)) == []
