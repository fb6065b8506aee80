"""What the secure cross-silo transport costs per message and per round, against FedML's own
(pickle over plaintext gRPC, a new channel per message), on the paper's MNIST model.

    python benchmarks/transport_cost.py [--messages 200] [--out benchmarks/results/transport_cost.md]

Measured in one process on loopback: encoding alone (pickle vs the wire format), and one model
message from rank 0 to rank 1 until the receiver holds the decoded message (FedML's transport;
the plugin's with comm_args.insecure; the plugin's with mutual TLS). A round of the paper's
cross-silo run is 10 models out and 10 uploads back: the per-round figure is 20 messages.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pickle
import statistics
import sys
import tempfile
import time
from argparse import Namespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fedml_perfedavg.net import wire  # noqa: E402  (installs the plugin)
from fedml_perfedavg.net.addresses import write_ipconfig  # noqa: E402
from fedml_perfedavg.net.credentials import make_certificates  # noqa: E402
from fedml_perfedavg.fedml_bridge.cross_silo.transport import SecureGRPCCommManager, to_message  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402

import fedml.core.distributed.communication.grpc.grpc_comm_manager as fedml_grpc  # noqa: E402
from fedml.core.distributed.communication.message import Message  # noqa: E402

MESSAGES_PER_ROUND = 20


def _median_ms(samples):
    return 1000 * statistics.median(samples), 1000 * min(samples), 1000 * max(samples)


def _model():
    torch.manual_seed(0)
    return create_model("mlp", (1, 28, 28), 10, [80, 60]).state_dict()


def _message(state):
    message = Message(wire.SYNC_MODEL, 0, 1)
    message.add_params(wire.MODEL_KEY, state)
    message.add_params("client_idx", "3")
    message.add_params("client_os", "PythonClient")
    return message


def encoding(state, n):
    pickled, wired = [], []
    for _ in range(n):
        start = time.perf_counter()
        pickle.loads(pickle.dumps(_message(state)))
        pickled.append(time.perf_counter() - start)
        start = time.perf_counter()
        envelope = wire.Envelope(
            type=wire.SYNC_MODEL,
            sender=0,
            receiver=1,
            run_id="r",
            round=0,
            seq=0,
            params={"client_idx": "3", "client_os": "PythonClient"},
            model=state,
        )
        wire.decode(wire.encode(envelope), 1 << 30)
        wired.append(time.perf_counter() - start)
    return pickled, wired, len(pickle.dumps(_message(state))), len(wire.encode(envelope))


def fedml_transport(folder, state, n):
    """FedML's own GRPCCommManager (reloaded: importing the plugin replaced it)."""
    original = importlib.reload(fedml_grpc).GRPCCommManager  # its methods read the module's name: kept until the end
    path = write_ipconfig(os.path.join(folder, "fedml.csv"), 2)
    sender, receiver = original(path, client_rank=0, client_num=1), original(path, client_rank=1, client_num=1)
    times = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            sender.send_message(_message(state))
            pickle.loads(receiver.grpc_servicer.message_q.get())
            times.append(time.perf_counter() - start)
    finally:
        sender.stop_receive_message()
        receiver.stop_receive_message()
        fedml_grpc.GRPCCommManager = SecureGRPCCommManager
    return times


def plugin_transport(folder, state, n, tls_dir):
    path = write_ipconfig(os.path.join(folder, f"plugin-{bool(tls_dir)}.csv"), 2)
    security = {"tls_dir": tls_dir} if tls_dir else {"insecure": True}
    args = Namespace(
        run_id="r", max_message_bytes=wire.default_size_cap(state), connect_timeout=30, round_idx=0, **security
    )
    sender = SecureGRPCCommManager(path, client_rank=0, client_num=1, args=args)
    receiver = SecureGRPCCommManager(path, client_rank=1, client_num=1, args=args)
    times = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            sender.send_message(_message(state))
            to_message(receiver._queue.get())
            times.append(time.perf_counter() - start)
    finally:
        sender.stop_receive_message()
        receiver.stop_receive_message()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "transport_cost.md"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    state = _model()
    with tempfile.TemporaryDirectory() as folder:
        tls = os.path.join(folder, "tls")
        make_certificates(tls, 1)
        pickled, wired, pickle_bytes, wire_bytes = encoding(state, args.messages)
        rows = [
            ("encode + decode: pickle (FedML)", pickled),
            ("encode + decode: JSON + safetensors (plugin)", wired),
            (
                "one message on loopback: FedML's transport (pickle, plaintext)",
                fedml_transport(folder, state, args.messages),
            ),
            (
                "one message on loopback: plugin, comm_args.insecure",
                plugin_transport(folder, state, args.messages, None),
            ),
            ("one message on loopback: plugin, mutual TLS", plugin_transport(folder, state, args.messages, tls)),
        ]
    lines = [
        f"# Cross-silo transport cost ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `python benchmarks/transport_cost.py --messages {args.messages}`; the paper's MNIST MLP "
        f"(784-80-60-10, {sum(v.numel() for v in state.values())} parameters); one process, loopback, 1 torch "
        f"thread. Bytes per model message: pickle {pickle_bytes}, wire format {wire_bytes}.",
        "",
        f"| what | median ms | min-max ms | per round ({MESSAGES_PER_ROUND} messages), ms |",
        "| --- | --- | --- | --- |",
    ]
    for name, samples in rows:
        median, low, high = _median_ms(samples)
        lines.append(f"| {name} | {median:.3f} | {low:.3f}-{high:.3f} | {MESSAGES_PER_ROUND * median:.1f} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as stream:
        stream.write(text)
    print(text)


if __name__ == "__main__":
    main()
