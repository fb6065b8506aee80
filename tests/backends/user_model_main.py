"""FedML's step-by-step main with the one import, which then saves what the model object it
handed FedMLRunner holds (``USER_MODEL_OUT``; rank 0 only): the final global model, as after
FedML's own FedAvg."""

import os

import fedml_perfedavg  # noqa: F401
import fedml
import torch
from fedml import FedMLRunner

if __name__ == "__main__":
    args = fedml.init()
    device = fedml.device.get_device(args)
    dataset, output_dim = fedml.data.load(args)
    model = fedml.model.create(args, output_dim)
    FedMLRunner(args, device, dataset, model).run()
    if int(getattr(args, "process_id", 0) or 0) == 0 and int(getattr(args, "rank", 0) or 0) == 0:
        torch.save(model.state_dict(), os.environ["USER_MODEL_OUT"])
