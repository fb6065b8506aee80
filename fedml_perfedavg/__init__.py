"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020) as a FedML plugin.

``import fedml_perfedavg`` is the one line a FedML user adds: it makes ``import fedml`` work
beside a CPU torch and installs the plugin into FedML, so that ``federated_optimizer:
PerFedAvg`` in a FedML YAML runs Per-FedAvg through FedML's own entry points.

The folders: ``core/`` (FedML-free maths), ``algorithms/`` (the algorithm objects and their
registry), ``data/`` (the paper's split, FedML's format), ``fedml_bridge/`` (everything that
touches FedML), ``engine/`` (the batched simulation), ``run/`` (config, runner, reporting,
command line).
"""

from .algorithms import FederatedAlgorithm, algorithm_names, create_algorithm, register
from .core.algorithm import LocalBatches, LocalUpdateConfig, local_update, meta_gradient
from .core.functional import functional_network, make_loss_fn, parameters_of
from .run.runner import install

install()

from .fedml_bridge.shims import create_fedml_pair  # noqa: E402  (FedML is importable now)

__version__ = "0.2.0"
__all__ = [
    "FederatedAlgorithm",
    "LocalBatches",
    "LocalUpdateConfig",
    "algorithm_names",
    "create_algorithm",
    "create_fedml_pair",
    "functional_network",
    "local_update",
    "make_loss_fn",
    "meta_gradient",
    "parameters_of",
    "register",
    "__version__",
]
