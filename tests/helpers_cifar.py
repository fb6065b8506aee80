"""Writes small files in CIFAR-10's python pickle layout (cifar-10-batches-py/)."""

import os
import pickle

import numpy as np


def write_fake_cifar10(root: str, train_per_class: int = 40, test_per_class: int = 10, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)

    def batch(per_class, name):
        labels = np.repeat(np.arange(10), per_class)
        rng.shuffle(labels)
        # class-dependent mean so a model can learn something
        data = (rng.integers(0, 128, (len(labels), 3072)) + labels[:, None] * 12).clip(0, 255).astype(np.uint8)
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({"data": data, "labels": labels.tolist(), "batch_label": name}, f)

    per_batch = max(1, train_per_class // 5)
    for i in range(1, 6):
        batch(per_batch, f"data_batch_{i}")
    batch(test_per_class, "test_batch")
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return root
