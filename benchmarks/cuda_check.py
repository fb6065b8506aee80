"""The CUDA path of the FedML-free core on a GPU: equivalence with the CPU, then speed.

    python benchmarks/cuda_check.py [--mnist-root ../shared/datasets] [--rounds 1000] [--out benchmarks/results]
    python benchmarks/cuda_check.py --compile-only   # torch.compile (CUDA graphs) of the HF round

Needs only torch (+ torchvision for MNIST), not FedML, so it runs on a bare GPU machine:
1. equivalence, float64: the batched engine on CUDA vs the per-client maths on the CPU
   (``algorithm.local_update`` per sampled client, plain average), 3 rounds, FedAvg/FO/HF/exact;
   and the batched personalized evaluation on CUDA vs the per-user one on the CPU;
2. speed, float32 on real MNIST (paper config): ms per training round of each method and ms of
   one personalized evaluation of all 50 users, CUDA-synchronised medians;
3. a full run: Per-FedAvg (HF), tau=10, K rounds, evaluation every 10 rounds, on the GPU; its
   wall time and final personalized accuracy.
Writes cuda.md and cuda.json under --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedml_perfedavg.algorithm import LocalUpdateConfig, local_update, make_loss_fn  # noqa: E402
from fedml_perfedavg.config import load_yaml, resolve  # noqa: E402
from fedml_perfedavg.engine import BatchedSimulation  # noqa: E402
from fedml_perfedavg.core.types import UserSplit, personalized_evaluation, personalized_evaluation_batched  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402
from fedml_perfedavg.sampling import Purpose, generator_for, sample_clients, sample_local_batches  # noqa: E402

HF_YAML = REPO / "yaml_configs" / "mnist_tau10_alpha0.01_hf.yaml"
METHODS = {"fedavg": "fedavg", "fo": "perfedavg", "hf": "perfedavg", "exact": "perfedavg"}


class UniformAggregator:
    """The hooks the batched engine calls, with the plugin's default (uniform) average."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.args = SimpleNamespace(round_idx=0)

    def on_before_aggregation(self, updates):
        return updates, list(range(len(updates)))

    def aggregate(self, updates):
        return {k: sum(sd[k] for _, sd in updates) / len(updates) for k in updates[0][1]}

    def on_after_aggregation(self, state):
        return state

    def set_model_params(self, state):
        self.model.load_state_dict(state)


def config_for(method: str, **overrides):
    variant = method if method != "fedavg" else "hf"
    return resolve(load_yaml(str(HF_YAML)), {"federated_optimizer": "FedAvg" if method == "fedavg" else "PerFedAvg",
                                             "perfedavg_variant": variant, "show_progress": False, **overrides})


def engine_for(config, method: str, users: List[UserSplit], model: torch.nn.Module) -> BatchedSimulation:
    update = LocalUpdateConfig(method=METHODS[method], variant=config.perfedavg_variant, alpha=config.alpha,
                               beta=config.beta, delta=config.delta, local_steps=config.local_steps)
    trainer = SimpleNamespace(loss_fn=make_loss_fn(model), update=update,
                              batch_sizes=(config.batch_size, config.meta_batch_size, config.hessian_batch_size))
    return BatchedSimulation(config, users, trainer, UniformAggregator(model))


def synthetic_users(n: int, samples: int, dtype: torch.dtype) -> List[UserSplit]:
    g = torch.Generator().manual_seed(0)
    users = []
    for _ in range(n):
        users.append(UserSplit(torch.rand(samples, 1, 28, 28, generator=g, dtype=dtype),
                               torch.randint(0, 10, (samples,), generator=g),
                               torch.rand(samples // 4, 1, 28, 28, generator=g, dtype=dtype),
                               torch.randint(0, 10, (samples // 4,), generator=g)))
    return users


def per_client_rounds(config, method: str, users: List[UserSplit], model: torch.nn.Module, rounds: int):
    """Reference: each sampled client's local update one by one on the CPU, plain average."""
    update = LocalUpdateConfig(method=METHODS[method], variant=config.perfedavg_variant, alpha=config.alpha,
                               beta=config.beta, delta=config.delta, local_steps=config.local_steps)
    loss_fn = make_loss_fn(model)
    sizes = (config.batch_size, config.meta_batch_size, config.hessian_batch_size)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    for r in range(rounds):
        clients = sample_clients(config.random_seed, r, config.client_num_in_total, config.client_num_per_round)
        new = []
        for c in clients:
            batches = sample_local_batches(users[c].train_x, users[c].train_y, config.local_steps, sizes,
                                           generator_for(config.random_seed, r, c, Purpose.LOCAL_TRAINING))
            new.append(local_update(loss_fn, params, batches, update))
        params = {k: sum(p[k] for p in new) / len(new) for k in params}
    return params


def equivalence(device: torch.device) -> Dict[str, float]:
    out = {}
    users = synthetic_users(10, 80, torch.float64)
    for method in METHODS:
        config = config_for(method, client_num_in_total=10, client_num_per_round=4, local_steps=3, beta=0.05,
                            batch_size=16, meta_batch_size=16, hessian_batch_size=16)
        torch.manual_seed(0)
        model = create_model("mlp", (1, 28, 28), 10, [80, 60]).double()
        reference = per_client_rounds(config, method, users, copy.deepcopy(model), 3)
        gpu_model = copy.deepcopy(model).to(device)
        engine = engine_for(config, method, [UserSplit(*(t.to(device) for t in u)) for u in users], gpu_model)
        for r in range(3):
            engine.train_round(r)
        got = dict(gpu_model.named_parameters())
        out[f"train_{method}_max_abs_diff"] = max(float((got[k].detach().cpu() - reference[k]).abs().max())
                                                  for k in reference)
        if method == "hf":
            cpu_model = copy.deepcopy(gpu_model).cpu()
            cpu = personalized_evaluation(cpu_model, make_loss_fn(cpu_model), dict(cpu_model.named_parameters()),
                                          users, config.alpha, 1, config.batch_size, 0, 3)
            gpu = personalized_evaluation_batched(gpu_model, make_loss_fn(gpu_model),
                                                  {k: p.detach() for k, p in gpu_model.named_parameters()},
                                                  engine.users, config.alpha, 1, config.batch_size, 0, 3)
            out["evaluation_per_user_accuracy_equal"] = cpu.per_user_accuracy == gpu.per_user_accuracy
            out["evaluation_max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(cpu.per_user_loss,
                                                                                gpu.per_user_loss))
    return out


def mnist_users(root: str, device: torch.device) -> List[UserSplit]:
    from fedml_perfedavg.data.loading import load_federated

    return load_federated("mnist", root, 50, "paper", 0).to(device).users


def timed_ms(fn, device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def speed(users: List[UserSplit], device: torch.device) -> Dict[str, float]:
    out = {}
    for method in METHODS:
        config = config_for(method)
        torch.manual_seed(0)
        model = create_model("mlp", (1, 28, 28), 10, [80, 60]).to(device)
        engine = engine_for(config, method, users, model)
        counter = iter(range(10 ** 6))
        out[f"train_{method}_ms_per_round"] = timed_ms(lambda: engine.train_round(next(counter)), device)
        if method == "hf":
            out["evaluation_50_users_ms"] = timed_ms(lambda: engine.evaluate(0), device, repeats=10)
    return out


def compiled_speed(users: List[UserSplit], device: torch.device) -> Dict[str, float]:
    """HF ms/round with the vmapped local update under ``torch.compile(mode="reduce-overhead")``
    (CUDA graphs), its compile time, and its distance to the eager result after 3 rounds."""
    out = {}
    models = {}
    for compiled in (False, True):
        config = config_for("hf")
        torch.manual_seed(0)
        model = create_model("mlp", (1, 28, 28), 10, [80, 60]).to(device)
        engine = engine_for(config, "hf", users, model)
        if compiled:
            engine.step = torch.compile(engine.step, mode="reduce-overhead", dynamic=False)
            start = time.perf_counter()
            engine.train_round(0)
            torch.cuda.synchronize(device)
            out["compiled_hf_first_round_s"] = time.perf_counter() - start
        else:
            engine.train_round(0)
        for r in (1, 2):
            engine.train_round(r)
        models[compiled] = {k: p.detach().clone() for k, p in model.named_parameters()}
        if compiled:
            counter = iter(range(3, 10 ** 6))
            out["compiled_hf_ms_per_round"] = timed_ms(lambda: engine.train_round(next(counter)), device)
    out["compiled_vs_eager_max_abs_diff_after_3_rounds"] = max(float((models[True][k] - models[False][k]).abs().max())
                                                               for k in models[True])
    return out


def full_run(users: List[UserSplit], device: torch.device, rounds: int) -> Dict[str, float]:
    config = config_for("hf", comm_round=rounds)
    torch.manual_seed(config.random_seed)
    model = create_model("mlp", (1, 28, 28), 10, [80, 60]).to(device)
    engine = engine_for(config, "hf", users, model)
    start = time.perf_counter()
    engine.run()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    result = engine.evaluate(rounds - 1)
    return {"full_run_rounds": rounds, "full_run_seconds": seconds,
            "full_run_personalized_accuracy": result.personalized_accuracy,
            "full_run_accuracy_before_adaptation": result.accuracy_before_adaptation}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--compile-only", action="store_true",
                        help="only measure torch.compile (CUDA graphs) of the HF round; writes cuda_compile.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(["python", "benchmarks/cuda_check.py", *sys.argv[1:]])}
    if args.compile_only:
        results.update(compiled_speed(mnist_users(args.mnist_root, device), device))
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "cuda_compile.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))
        return 0
    results.update(equivalence(device))
    print(json.dumps(results, indent=1), flush=True)
    users = mnist_users(args.mnist_root, device)
    results.update(speed(users, device))
    print(json.dumps(results, indent=1), flush=True)
    results.update(full_run(users, device, args.rounds))
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "cuda.json").write_text(json.dumps(results, indent=1))
    lines = [f"# CUDA check ({results['date']}, {results['device']}, torch {results['torch']})", "",
             f"Command: `{results['command']}`", "", "| measure | value |", "| --- | --- |"]
    lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in results.items()
              if k not in ("device", "torch", "python", "date", "command")]
    Path(args.out, "cuda.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
