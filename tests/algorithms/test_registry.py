"""An algorithm added as one file plus a registry entry runs on FedML's sp loop and the
batched engine, with the same result on both."""

import pytest
import torch

from fedml_perfedavg.models import create_model
from fedml_perfedavg.run.config import resolve
from fedml_perfedavg.run.runner import run

from tests.algorithms import sign_sgd  # noqa: F401  registers SignSGD
from tests.helpers_tiny import tiny_data


pytestmark = pytest.mark.backend  # FedML's own sp loop and the batched engine, whole runs


def test_a_registered_algorithm_runs_on_fedml_sp_loop_and_the_batched_engine(tmp_path):
    results = {}
    for engine in ("fedml", "batched"):
        config = resolve(
            {},
            dict(
                federated_optimizer="SignSGD",
                client_num_in_total=6,
                client_num_per_round=3,
                comm_round=3,
                local_steps=2,
                batch_size=8,
                beta=0.01,
                hidden_sizes=[5],
                frequency_of_the_test=1,
                show_progress=False,
                simulation_engine=engine,
            ),
        )
        results[engine] = run(config, str(tmp_path / engine), data=tiny_data())
    fedml, batched = results["fedml"], results["batched"]
    assert type(fedml.algorithm).__name__ == "SignSGD" and fedml.trainer.train_calls == 9
    assert fedml.summary["aggregate_calls"] == batched.summary["aggregate_calls"] == 3
    for k, v in fedml.final_state.items():
        torch.testing.assert_close(v, batched.final_state[k], rtol=1e-6, atol=1e-7)
    assert fedml.summary["per_user_accuracy"] == batched.summary["per_user_accuracy"]
    # Every local step moves each weight by exactly beta (the sign's size), and the server averages
    # 3 clients: each weight moved by a whole multiple of beta / 3. FedAvg's gradient steps would not.
    torch.manual_seed(0)  # the run's own initial model (runner: seeded by random_seed)
    start = create_model("mlp", (1, 4, 4), 3, [5]).state_dict()
    for k, v in batched.final_state.items():
        steps = (v - start[k]) / (0.01 / 3)
        torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-3)
        assert steps.abs().max() > 0
    assert start.keys() == fedml.final_state.keys()
