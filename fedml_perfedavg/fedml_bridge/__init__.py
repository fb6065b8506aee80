"""The FedML bridge: :func:`.install.install` is the one entry point; one module per thing
it adapts (bootstrap: import, offline init, FedML's home; dispatch: ``FedMLRunner``;
data_and_models: ``fedml.data.load`` and ``fedml.model.create``; sp; mpi; cross_silo: the
transport, server and silo; trainer_aggregator: ``ClientTrainer``/``ServerAggregator`` over an
algorithm object)."""

from .install import install, is_installed

__all__ = ["install", "is_installed"]
