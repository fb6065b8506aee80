"""torchvision beside the CPU torch wheel (a fix for PyPI's wheels, needed by FedML too)."""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
import sys

import torch

logger = logging.getLogger(__name__)
_torchvision_schemas = None  # keeps the torch.library definitions alive


def make_torchvision_importable() -> None:
    """PyPI's torchvision wheels are CUDA builds: beside a CPU torch their compiled ops fail to
    load and ``torchvision/_meta_registrations.py`` raises "operator torchvision::nms does not
    exist" at import. ``import fedml`` imports torchvision (core/alg_frame/client_trainer.py ->
    core/security/...), so FedML breaks too. Load the extension if it can be loaded; else
    declare the two operator schemas the meta registrations need. Only ``torchvision.ops``
    is then unavailable, which nothing here uses."""
    global _torchvision_schemas
    if "torchvision" in sys.modules or _torchvision_schemas is not None:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for lib in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(lib)
            return
        except (OSError, RuntimeError):
            pass
    library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_schemas = library
    logger.debug("torchvision's compiled ops could not be loaded; declared nms/qnms schemas instead")
