"""Which FedML transports a cross-silo process may use: FedML's TRPC and MQTT backends pass pickles
in plaintext or through services outside the run, so a plugin run (and a FedML user who asks for the
plugin's fixes) refuses them, saying why. No FedML or gRPC import: ``fedml.init`` checks this first."""

from __future__ import annotations

from typing import Any

from ...core.errors import ConfigError

INSECURE_BACKENDS = {
    "TRPC": "FedML's TRPC transport (core/distributed/communication/trpc) sends pickles in plaintext and listens on "
    "every interface",
    "MQTT_S3": "FedML's MQTT_S3 transport (core/distributed/communication/mqtt_s3) passes pickled models through a "
    "broker and a bucket outside the run, with no authentication of the sender",
    "MQTT_S3_MNN": "FedML's MQTT_S3_MNN transport passes models through a broker and a bucket outside the run, with "
    "no authentication of the sender",
    "MQTT_WEB3": "FedML's MQTT_WEB3 transport passes pickled models through services outside the run",
    "MQTT_THETASTORE": "FedML's MQTT_THETASTORE transport passes pickled models through services outside the run",
}


def check_cross_silo_backend(args: Any) -> None:
    """A plugin run's cross-silo process (or one whose FedML user asked for the plugin's fixes) talks
    over the plugin's secured gRPC transport or not at all: FedML's pickling backends are refused,
    saying why."""
    if getattr(args, "training_type", None) != "cross_silo":
        return
    backend = getattr(args, "backend", None)
    if backend in INSECURE_BACKENDS:
        raise ConfigError(
            f"comm_args.backend={backend!r}: refused for cross-silo by fedml-perfedavg (a plugin algorithm's run, "
            f"or common_args.plugin_fixes): "
            f"{INSECURE_BACKENDS[backend]}. Use backend: GRPC, which the plugin secures (mutual TLS "
            f"with comm_args.tls_dir, messages never unpickled, connections capped)"
        )
