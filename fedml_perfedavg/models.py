"""The paper's model (MLP 80-60, ELU) and a small CNN, offered through ``fedml.model.create``."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import nn

MODELS = ("mlp", "small_cnn")  # FedML's own names (lr, cnn, resnet56, ...) stay FedML's


class MLP(nn.Module):
    """Fully connected network with ELU activations; the paper uses hidden sizes (80, 60)."""

    def __init__(self, input_dim: int, num_classes: int, hidden: Sequence[int] = (80, 60)) -> None:
        super().__init__()
        layers: List[nn.Module] = [nn.Flatten()]
        width = input_dim
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ELU()]
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv layers and two dense layers; an option beyond the paper's MLP."""

    def __init__(self, input_shape: Tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 5, padding=2),
            nn.ELU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2),
            nn.ELU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * (height // 4) * (width // 4), 64), nn.ELU(), nn.Linear(64, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def create_model(
    name: str, input_shape: Tuple[int, ...], num_classes: int, hidden: Sequence[int] = (80, 60)
) -> nn.Module:
    """Build the model called ``name`` ('mlp' or 'small_cnn') for images of ``input_shape`` (C, H, W)."""
    if name == "mlp":
        channels, height, width = input_shape
        return MLP(channels * height * width, num_classes, hidden)
    if name == "small_cnn":
        return SmallCNN(input_shape, num_classes)
    raise ValueError(f"model_args.model={name!r} is not one of {MODELS}")
