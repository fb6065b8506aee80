"""This plugin's HF (or FO) round against FL-bench's Per-FedAvg, their rounds alternated in one process.

    python benchmarks/flbench_round.py [--variant hf|fo] [--rounds 20] [--out benchmarks/results]

FL-bench (github.com/KarhouTam/FL-bench) is the public implementation people compare with. Its
Per-FedAvg client is transcribed here from ``src/client/perfedavg.py`` at commit 06e658b (the
``fit`` loop: a ``deepcopy`` of the state dict each step, the HF variant's two extra model
copies, ``DataLoader`` minibatches of 40 drawn with ``shuffle=True`` from a ``Subset`` of one
dataset tensor, each sample through ``transforms.Normalize`` as its ``BaseDataset`` and MNIST
transform do, data/utils/datasets.py and src/server/fedavg.py) with ``src/client/fedavg.py``'s
round around it (``load_state_dict`` of the global model, the trained state cloned back; not
its evaluations before and after training, which this plugin's round does not do either) and
its server's plain average; what it is given is the paper's MNIST config (the 50 users' split,
10 clients a round, tau = 10 local steps, the MLP 784-80-60-10 with ELU, alpha 0.001... as
``speed.py`` configures this plugin, 2 torch threads). Its client runs tau meta-steps (not
``len(trainloader) // 3`` per epoch) so both sides do the paper's work. Each pair of rounds
(one of each, in turn) meets the same machine state: the ratio holds where the machine's pace
drifts. Writes flbench_<variant>.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import OrderedDict
from copy import deepcopy
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from speed import config_for, load_users, method_engine  # noqa: E402

from fedml_perfedavg.core.types import model_inputs  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402


class FLBenchDataset(Dataset):
    """FL-bench's BaseDataset (data/utils/datasets.py) with its MNIST training transform."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor) -> None:
        self.data, self.targets = data, targets
        self.data_transform = transforms.Compose([transforms.Normalize([0.1307], [0.3015])])

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index):
        data, targets = self.data[index], self.targets[index]
        return self.data_transform(data), targets


class FLBenchPerFedAvgClient:
    """FL-bench's PerFedAvgClient.fit (src/client/perfedavg.py, 06e658b), its statements kept."""

    def __init__(self, model: torch.nn.Module, version: str, alpha: float, beta: float, delta: float) -> None:
        self.model, self.version, self.alpha, self.delta = model, version, alpha, delta
        self.criterion = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=alpha)
        self.meta_optimizer = torch.optim.SGD(self.model.parameters(), lr=beta)
        if version == "hf":
            self.model_plus = deepcopy(self.model)
            self.model_minus = deepcopy(self.model)

    def train(self, global_params: "OrderedDict[str, torch.Tensor]", loader: DataLoader, steps: int) -> dict:
        # FedAvgClient.set_parameters / train / package
        self.model.load_state_dict(global_params, strict=False)
        self.trainloader = loader
        self.fit(steps)
        return OrderedDict((k, v.clone().cpu()) for k, v in self.model.state_dict().items())

    def fit(self, steps: int) -> None:
        self.model.train()
        self.iter_trainloader = iter(self.trainloader)
        for _ in range(steps):
            x0, y0 = self.get_data_batch()
            frz_params = deepcopy(self.model.state_dict())
            logit = self.model(x0)
            loss = self.criterion(logit, y0)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()

            x1, y1 = self.get_data_batch()
            logit = self.model(x1)
            loss = self.criterion(logit, y1)
            self.meta_optimizer.zero_grad()
            loss.backward()

            if self.version == "hf":
                self.model_plus.load_state_dict(frz_params)
                self.model_minus.load_state_dict(frz_params)
                x2, y2 = self.get_data_batch()
                for param_p, param_m, param_cur in zip(
                    self.model_plus.parameters(), self.model_minus.parameters(), self.model.parameters()
                ):
                    param_p.data += self.delta * param_cur.grad
                    param_m.data -= self.delta * param_cur.grad
                loss_plus = self.criterion(self.model_plus(x2), y2)
                loss_minus = self.criterion(self.model_minus(x2), y2)
                loss_plus.backward()
                loss_minus.backward()
                for param_cur, param_plus, param_minus in zip(
                    self.model.parameters(), self.model_plus.parameters(), self.model_minus.parameters()
                ):
                    param_cur.grad = param_cur.grad - self.alpha / (2 * self.delta) * (
                        param_plus.grad - param_minus.grad
                    )
                    param_plus.grad.zero_()
                    param_minus.grad.zero_()

            self.model.load_state_dict(frz_params)
            self.meta_optimizer.step()

    def get_data_batch(self):
        try:
            x, y = next(self.iter_trainloader)
            if len(x) <= 1:
                x, y = next(self.iter_trainloader)
        except StopIteration:
            self.iter_trainloader = iter(self.trainloader)
            x, y = next(self.iter_trainloader)
        return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=["hf", "fo"], default="hf")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    users, source = load_users(50, "cpu")
    engine, algorithm = method_engine(args.variant, users)
    config = config_for(args.variant)
    alpha, beta, delta, steps = config.train.alpha, config.train.beta, config.setting("delta"), config.train.local_steps
    batch = config.train.batch_size
    torch.manual_seed(0)
    model = create_model("mlp", (1, 28, 28), 10)
    client = FLBenchPerFedAvgClient(model, args.variant, alpha, beta, delta)
    # one dataset tensor of every user's samples, each user's a Subset of it (values: only time is compared)
    dataset = FLBenchDataset(model_inputs(torch.cat([u.train_x for u in users])), torch.cat([u.train_y for u in users]))
    offsets = [0]
    for u in users:
        offsets.append(offsets[-1] + len(u.train_y))
    loaders = [
        DataLoader(Subset(dataset, list(range(offsets[i], offsets[i + 1]))), batch_size=batch, shuffle=True)
        for i in range(len(users))
    ]
    global_params = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())

    def flbench_round(round_idx: int) -> None:
        nonlocal global_params
        updates = [client.train(global_params, loaders[c], steps) for c in algorithm.sample_clients(round_idx)]
        # FedAvgServer.aggregate: weights 1 (PerFedAvgClient.package), normalized
        global_params = OrderedDict(
            (k, torch.stack([u[k] for u in updates]).mean(dim=0) if v.is_floating_point() else v)
            for k, v in global_params.items()
        )

    times: dict = {"plugin": [], "flbench": []}
    for round_idx in range(args.rounds + 2):  # two untimed rounds each first
        for name, step in (("plugin", engine.train_round), ("flbench", flbench_round)):
            start = time.perf_counter()
            step(round_idx)
            if round_idx >= 2:
                times[name].append((time.perf_counter() - start) * 1000)
    ratios = [f / p for p, f in zip(times["plugin"], times["flbench"])]
    result = {
        "variant": args.variant,
        "rounds": args.rounds,
        "data": source,
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "command": "python benchmarks/flbench_round.py " + " ".join(sys.argv[1:]),
        "flbench": "KarhouTam/FL-bench 06e658b, src/client/perfedavg.py (transcribed)",
        "plugin_ms": statistics.median(times["plugin"]),
        "flbench_ms": statistics.median(times["flbench"]),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"flbench_{args.variant}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
