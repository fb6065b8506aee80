"""One round of Flower's SecAgg+ (flwr's own client stages and server unmasking), timed, for
``benchmarks/secagg_cost.py``. Runs in a venv with ``flwr`` (it cannot share FedML's: flwr needs
protobuf >= 4, FedML 0.9.6 protobuf < 4):

    VENV/bin/python benchmarks/secagg_flower_round.py --clients 10 --length 59210

Every client's four stages run here in turn (``flwr.client.mod.secure_aggregation.secaggplus_mod``'s
``_setup``, ``_share_keys``, ``_collect_masked_vectors``, ``_unmask``, called as its mod calls them,
on the complete graph: share_num = clients), then the server's unmasking as
``flwr.server.workflow.secure_aggregation.secaggplus_workflow`` does it. Prints one JSON object:
seconds per client for each stage (mean), the server's unmasking seconds, and the bytes each client
sends (the values of its replies, without Flower's message envelope).
"""

import argparse
import importlib
import io
import json
import time

import numpy as np

from flwr.common import ndarrays_to_parameters
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_mod, parameters_subtraction
from flwr.common.secure_aggregation.secaggplus_constants import Key
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

# The module, not the function of the same name that its package exports.
mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")


def size(value) -> int:
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(size(v) for v in value)
    if isinstance(value, dict):
        return sum(size(v) for v in value.values())
    return 8  # an int


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--length", type=int, default=59210)
    parser.add_argument("--threshold", type=int, default=None)
    args = parser.parse_args()
    n, d = args.clients, args.length
    t = args.threshold or n // 2 + 1
    ids = list(range(1, n + 1))
    states = {i: mod.SecAggPlusState(nid=i) for i in ids}
    seconds = {stage: 0.0 for stage in ("setup", "share_keys", "masked", "unmask")}
    sent = {i: 0 for i in ids}
    configs = {
        Key.SAMPLE_NUMBER: n,
        Key.SHARE_NUMBER: n,
        Key.THRESHOLD: t,
        Key.CLIPPING_RANGE: 8.0,
        Key.TARGET_RANGE: 1 << 22,
        Key.MOD_RANGE: 1 << 32,
        Key.MAX_WEIGHT: 1000.0,
    }
    keys = {}
    for i in ids:
        start = time.perf_counter()
        reply = mod._setup(states[i], configs)
        seconds["setup"] += time.perf_counter() - start
        keys[str(i)] = (reply[Key.PUBLIC_KEY_1], reply[Key.PUBLIC_KEY_2])
        sent[i] += size(reply)
    shares = {}
    for i in ids:
        start = time.perf_counter()
        reply = mod._share_keys(states[i], dict(keys))
        seconds["share_keys"] += time.perf_counter() - start
        shares[i] = reply
        sent[i] += size(reply)
    generator = np.random.default_rng(0)
    masked_sum = None
    for i in ids:
        srcs = [j for j in ids if j != i]
        ciphertexts = [shares[j][Key.CIPHERTEXT_LIST][shares[j][Key.DESTINATION_LIST].index(i)] for j in srcs]
        update = ndarrays_to_parameters([generator.normal(0, 0.05, d).astype(np.float32)])
        start = time.perf_counter()
        reply = mod._collect_masked_vectors(
            states[i], {Key.CIPHERTEXT_LIST: ciphertexts, Key.SOURCE_LIST: srcs}, 1, update
        )
        seconds["masked"] += time.perf_counter() - start
        sent[i] += size(reply)
        arrays = [np.load(io.BytesIO(b)) for b in reply[Key.MASKED_PARAMETERS]]
        masked_sum = arrays if masked_sum is None else [a + b for a, b in zip(masked_sum, arrays)]
    collected = {i: [] for i in ids}
    for i in ids:
        start = time.perf_counter()
        reply = mod._unmask(states[i], {Key.ACTIVE_NODE_ID_LIST: ids, Key.DEAD_NODE_ID_LIST: []})
        seconds["unmask"] += time.perf_counter() - start
        sent[i] += size(reply)
        for owner, share in zip(reply[Key.NODE_ID_LIST], reply[Key.SHARE_LIST]):
            collected[owner].append(share)
    start = time.perf_counter()
    vector = masked_sum
    for share_list in collected.values():
        secret = combine_shares(share_list[:t])
        vector = parameters_subtraction(vector, pseudo_rand_gen(secret, 1 << 32, [a.shape for a in vector]))
    vector = parameters_mod(vector, 1 << 32)
    server_seconds = time.perf_counter() - start
    # One dropped client costs the server its pairwise masks with every survivor: timed too.
    start = time.perf_counter()
    secret = combine_shares(collected[ids[0]][:t])
    for neighbour in ids[1:]:
        key = generate_shared_key(bytes_to_private_key(states[ids[0]].sk1), bytes_to_public_key(states[neighbour].pk1))
        pseudo_rand_gen(key, 1 << 32, [a.shape for a in vector])
    dropout_seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "clients": n,
                "length": d,
                "threshold": t,
                "client_seconds": {k: v / n for k, v in seconds.items()},
                "server_unmask_seconds": server_seconds,
                "server_seconds_per_dropout": dropout_seconds,
                "bytes_per_client": sum(sent.values()) / n,
            }
        )
    )


if __name__ == "__main__":
    main()
