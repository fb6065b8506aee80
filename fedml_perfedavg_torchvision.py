"""torchvision beside the CPU torch wheel, whatever is imported first.

PyPI's torchvision wheels are CUDA builds: beside a CPU torch their compiled ops fail to load and
``torchvision/_meta_registrations.py`` raises "operator torchvision::nms does not exist" at
import. ``import fedml`` imports torchvision (core/alg_frame/client_trainer.py ->
core/security/...), so FedML breaks too, even before ``import fedml_perfedavg`` could help (isort
puts ``import fedml`` first). ``fedml_perfedavg_torchvision.pth`` imports this module at
interpreter start; it only registers an import hook (no torch import), which applies the fix
the first time anything imports torchvision. Kept outside the ``fedml_perfedavg`` package so
that importing it starts nothing else.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import sys

_torchvision_schemas = None  # keeps the torch.library definitions alive


def make_torchvision_importable() -> None:
    """Load torchvision's compiled ops if they load; else declare the two operator schemas its
    meta registrations need. Only ``torchvision.ops`` is then unavailable."""
    global _torchvision_schemas
    if "torchvision" in sys.modules or _torchvision_schemas is not None:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    for lib in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(lib)
            return
        except (OSError, RuntimeError):
            pass
    try:  # declared already (by another copy of this module: an interpreter's .pth and a test runner's path)
        torch._C._get_schema("torchvision::nms", "")
        return
    except RuntimeError:
        pass
    library = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_schemas = library


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Applies :func:`make_torchvision_importable` just before torchvision is first imported,
    then steps aside (it finds nothing itself)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            uninstall()
            try:
                make_torchvision_importable()
            except Exception:  # never break an import that might have worked: torchvision reports its own error
                pass
        return None


_HOOK = _BeforeTorchvision()


def install() -> None:
    """Register the import hook (the .pth file calls this at interpreter start)."""
    if "torchvision" not in sys.modules and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def uninstall() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
