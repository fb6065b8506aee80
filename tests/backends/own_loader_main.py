"""FedML's step-by-step main with the one import, a data loader and a model of the user's own:
4 users of random 3x32x32 images (the same in every process: seeded), and either FedML's
``resnet56`` or a small CNN with BatchNorm and dropout (``model_args.model``: resnet56 or
batchnorm_cnn)."""

import fedml_perfedavg  # noqa: F401
import fedml
import torch
from fedml import FedMLRunner
from torch import nn

from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.data.fedml_format import to_fedml_dataset


def users(count: int = 4):
    g = torch.Generator().manual_seed(0)
    return [
        UserSplit(
            torch.rand(16, 3, 32, 32, generator=g),
            torch.randint(0, 10, (16,), generator=g),
            torch.rand(8, 3, 32, 32, generator=g),
            torch.randint(0, 10, (8,), generator=g),
        )
        for _ in range(count)
    ]


def model_named(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "resnet56":
        from fedml.model.cv.resnet import resnet56

        return resnet56(10)
    return nn.Sequential(
        nn.Conv2d(3, 6, 5),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(6 * 14 * 14, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


if __name__ == "__main__":
    args = fedml.init()
    device = fedml.device.get_device(args)
    dataset = to_fedml_dataset(users(), 10, int(args.batch_size))
    FedMLRunner(args, device, dataset, model_named(args.model)).run()
