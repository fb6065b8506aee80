"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020) as a FedML plugin.

``import fedml_perfedavg`` is the one line a FedML user adds: it installs the plugin into FedML
(at once if FedML is imported already, else right after ``import fedml``), so that
``federated_optimizer: PerFedAvg`` in a FedML YAML runs Per-FedAvg through FedML's own entry
points. Importing a part alone (``fedml_perfedavg.core``, ``.algorithms``, ``.data``) imports
neither FedML nor gRPC and changes nothing in FedML until FedML is imported.

The folders: ``core/`` (FedML-free maths), ``algorithms/`` (the algorithm objects and their
registry), ``data/`` (the paper's split, FedML's format), ``fedml_bridge/`` (everything that
touches FedML), ``engine/`` (the batched simulation), ``run/`` (config, runner, reporting,
command line). docs/architecture.md follows one round through them.
"""

from typing import Any

from .import_cost import collector_paused

with collector_paused():  # torch's import, without the collector walking it (import_cost.py)
    import torch  # noqa: F401

    from .algorithms import FederatedAlgorithm, algorithm_names, create_algorithm, register
    from .core.errors import ConfigError, DivergenceError, OutputError, RunStopped, SiloFailure
    from .core.client_maths import LocalBatches, LocalUpdateConfig, local_update, meta_gradient
    from .core.functional import functional_network, make_loss_fn, parameters_of
    from .fedml_bridge.bootstrap import when_fedml_is_imported


def _install() -> None:
    from .run.runner import install

    install()


when_fedml_is_imported(_install)

__version__ = "0.2.0"
__all__ = [
    "ConfigError",
    "DivergenceError",
    "OutputError",
    "RunStopped",
    "SiloFailure",
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


def __getattr__(name: str) -> Any:
    if name == "create_fedml_pair":  # FedML's trainer/aggregator classes: imports FedML (and so installs)
        from .fedml_bridge.trainer_aggregator import create_fedml_pair

        return create_fedml_pair
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
