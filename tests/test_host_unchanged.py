"""Issue 77: a FedML user imports one plugin to get one algorithm; FedML's own algorithms in the same
process keep FedML's transport and MPI loop unless their YAML asks for the plugin's fixes
(common_args.plugin_fixes). Each check in a fresh interpreter: another test's opt-in stays in its own."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

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
