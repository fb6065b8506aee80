"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020) as a FedML plugin.

The algorithm's maths (:mod:`.algorithm`, :mod:`.evaluation`) is plain PyTorch; FedML glue
(:mod:`.trainer`, :mod:`.runner`) sits on top, with every FedML workaround in
:mod:`.fedml_compat`.
"""
from .algorithm import LocalBatches, LocalUpdateConfig, local_update, make_loss_fn, meta_gradient

__version__ = "0.1.0"
__all__ = ["LocalBatches", "LocalUpdateConfig", "local_update", "make_loss_fn", "meta_gradient", "__version__"]
