"""The FedML bridge: :func:`.install.install` is the one entry point; one module per thing
it adapts (bootstrap: import/offline/home; dispatch: ``FedMLRunner``; hub: data and models;
sp; mpi; cross_silo: transport, server, client; shims: ``ClientTrainer``/``ServerAggregator``
over an algorithm object)."""

from .install import install, is_installed

__all__ = ["install", "is_installed"]
