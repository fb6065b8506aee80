"""A FedML user's main script that hands its own trainer/aggregator pair to ``FedMLRunner``
(FedML's step-by-step example plus one import). Each process writes what its pair did to
``<output_dir>/own_pair_rank<rank>.json``, so a test can tell whether FedML really used it."""

import json
import os
from collections import OrderedDict

import fedml_perfedavg  # noqa: F401

import fedml
import torch
from fedml import FedMLRunner
from fedml.core import ClientTrainer, ServerAggregator

CALLS = {"train": 0, "set_id": 0, "aggregate": 0, "before_aggregation": 0, "test_all": 0}


class StateDictParams:
    """get/set_model_params as a state_dict, for both sides of the pair."""

    def get_model_params(self):
        # an OrderedDict, as state_dict() gives: FedML's cross-silo server reads a plain dict as one model per silo
        return OrderedDict((k, v.clone()) for k, v in self.model.state_dict().items())

    def set_model_params(self, params):
        self.model.load_state_dict(params)


class PlusOneTrainer(StateDictParams, ClientTrainer):
    """Adds 1 to every parameter: the global model after k rounds is the start plus k."""

    def set_id(self, trainer_id):
        CALLS["set_id"] += 1
        super().set_id(trainer_id)

    def train(self, train_data, device, args):
        CALLS["train"] += 1
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)


class CountingAggregator(StateDictParams, ServerAggregator):
    """FedML's default aggregation, counting the hooks FedML calls."""

    def on_before_aggregation(self, updates):
        CALLS["before_aggregation"] += 1
        return super().on_before_aggregation(updates)

    def aggregate(self, updates):
        CALLS["aggregate"] += 1
        return super().aggregate(updates)

    def test(self, test_data, device, args):
        return {}

    def test_all(self, train_data_local_dict, test_data_local_dict, device, args):
        CALLS["test_all"] += 1
        return True


if __name__ == "__main__":
    args = fedml.init()
    device = fedml.device.get_device(args)
    dataset, output_dim = fedml.data.load(args)
    model = fedml.model.create(args, output_dim)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    runner = FedMLRunner(args, device, dataset, model, PlusOneTrainer(model, args), CountingAggregator(model, args))
    rank = int(getattr(args, "process_id", getattr(args, "rank", 0)) or 0)
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"own_pair_rank{rank}.json")
    # FedML's MPI server ends in MPI.Finalize(): record before run() returns on every rank too
    try:
        runner.run()
    finally:
        shift = [float((model.state_dict()[k] - start[k]).float().mean()) for k in start]
        with open(path, "w") as f:
            json.dump({"calls": CALLS, "runner": type(runner.runner).__name__, "shift": shift}, f)
