"""torchvision beside the CPU torch wheel (a fix for PyPI's wheels, needed by FedML too); the
implementation lives in the top-level ``fedml_perfedavg_torchvision`` module, which the installed
``.pth`` file also loads at interpreter start, so ``import fedml`` works in either import order."""

from __future__ import annotations

from fedml_perfedavg_torchvision import make_torchvision_importable

__all__ = ["make_torchvision_importable"]
