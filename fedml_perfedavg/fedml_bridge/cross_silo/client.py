"""The cross-silo client (a silo): FedML's trainer, its adapter and the client manager
(cross_silo/client/) with the user id passed on, an idle limit, and the silo's own
personalized evaluation sent to the server.
"""
from __future__ import annotations

import logging
import platform
import time
from typing import Any, Dict, Optional

from ...core.guards import SiloFailure
from ..bootstrap import import_fedml
from .policy import SiloPolicy
from .transport import PeerUnreachable
from .wire import SILO_METRICS

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager  # noqa: E402
from fedml.cross_silo.client.fedml_trainer import FedMLTrainer  # noqa: E402
from fedml.cross_silo.client.fedml_trainer_dist_adapter import TrainerDistAdapter  # noqa: E402
from fedml.cross_silo.client.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)


class PluginFedMLTrainer(FedMLTrainer):
    """cross_silo/client/fedml_trainer.py never tells the ``ClientTrainer`` which user it now
    trains (``set_id``), so minibatches would be drawn as the silo's first user. Each model
    received is also evaluated here, personalized, on the silo's user of that round."""

    models_received = 0
    last_metrics: Optional[Dict[str, Any]] = None

    def update_dataset(self, client_index):
        super().update_dataset(client_index)
        self.trainer.set_id(client_index)

    def update_model(self, weights):
        super().update_model(weights)
        round_idx = self.models_received  # the model after this many rounds
        self.models_received += 1
        self.args.round_idx = round_idx
        result = self.trainer.test(self.test_local, self.device, self.args)
        total = result["test_total"]
        self.last_metrics = {"round": round_idx, "user": int(self.client_index),
                             "accuracy": result["test_correct"] / total,
                             "accuracy_before_adaptation": result["test_correct_before_adaptation"] / total}

class PluginTrainerDistAdapter(TrainerDistAdapter):
    def get_trainer(self, client_index, train_data_local_dict, train_data_local_num_dict, test_data_local_dict,
                    train_data_num, device, args, model_trainer):
        return PluginFedMLTrainer(client_index, train_data_local_dict, train_data_local_num_dict,
                                  test_data_local_dict, train_data_num, device, args, model_trainer)

    def update_dataset(self, client_index=None):
        # fedml_trainer_dist_adapter.py: ``client_index or self.client_index`` turns user 0
        # into the silo's own index.
        self.trainer.update_dataset(int(self.client_index if client_index is None else client_index))

class PluginClientMasterManager(ClientMasterManager):
    """fedml_client_master_manager.py: a silo waits for the server forever, and its
    evaluations never reach the server. Here a silo that hears nothing from the server for
    ``SiloPolicy.client_idle_deadline`` (adaptive, see there) stops, and its evaluation of the
    model it received rides on its upload (and on its goodbye, for the final model)."""

    GOODBYE_SECONDS = 2.0  # a finished run's goodbye: a server that has already ended is not waited for

    def __init__(self, args: Any, trainer_dist_adapter: Any, comm: Any = None, rank: int = 0, size: int = 0,
                 backend: str = "GRPC", *, policy: SiloPolicy) -> None:
        super().__init__(args, trainer_dist_adapter, comm, rank, size, backend)
        self.policy = policy
        self.last_heard = time.monotonic()
        self.last_model: Optional[float] = None
        self.slowest_gap: Optional[float] = None  # between two models from the server
        self.gaps_measured = 0

    def receive_message(self, msg_type, msg_params) -> None:
        now = self.last_heard = time.monotonic()
        if msg_type == MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT and self.last_model is not None:
            self.slowest_gap = max(now - self.last_model, self.slowest_gap or 0.0)
            self.gaps_measured += 1
        if msg_type in (MyMessage.MSG_TYPE_S2C_INIT_CONFIG, MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT):
            self.last_model = now
            # An upload to a server that was up and is gone is retried no longer than it is waited for.
            limit = self.policy.client_idle_deadline(self.slowest_gap, self.gaps_measured)
            self.com_manager.retry_seconds = min(self.policy.connect_timeout, limit)
        super().receive_message(msg_type, msg_params)

    def on_idle(self) -> None:
        limit = self.policy.client_idle_deadline(self.slowest_gap, self.gaps_measured)
        if time.monotonic() - self.last_heard > limit:
            self.com_manager.stop_receive_message()
            raise SiloFailure(f"silo rank {self.rank}: nothing from the server for {limit:.1f} s (comm_args."
                              f"round_timeout_factor x the slowest round so far; before two rounds: 2 x comm_args."
                              f"round_timeout + comm_args.connect_timeout); is the server gone?")

    def handle_message_finish(self, msg_params):
        logger.warning("silo rank %d: the server ended the run early", self.rank)
        self.finish()

    def _metrics(self) -> Optional[Dict[str, Any]]:
        return self.trainer_dist_adapter.trainer.last_metrics

    def send_model_to_server(self, receive_id, weights, local_sample_num):
        message = Message(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, self.client_real_id, receive_id)
        message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, weights)
        message.add_params(MyMessage.MSG_ARG_KEY_NUM_SAMPLES, local_sample_num)
        message.add_params(SILO_METRICS, self._metrics())
        self.send_message(message)

    def send_client_status(self, receive_id, status=ClientMasterManager.ONLINE_STATUS_FLAG):
        message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, receive_id)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, status)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, platform.system())
        if status != ClientMasterManager.RUN_FINISHED_STATUS_FLAG:
            self.send_message(message)
            return
        message.add_params(SILO_METRICS, self._metrics())
        try:
            self.com_manager.send_message(message, deadline=time.monotonic() + self.GOODBYE_SECONDS)
        except PeerUnreachable as err:
            logger.info("silo rank %d: the server has already ended (%s); this silo is done", self.rank, err)
