"""FedML's step-by-step example (examples/federate/simulation/sp_fedavg_mnist_lr_example/
step_by_step/torch_fedavg_mnist_lr_step_by_step_example.py) with one added line.

    python torch_perfedavg_mnist_lr_step_by_step_example.py --cf fedml_config.yaml
    mpirun -n 3 python torch_perfedavg_mnist_lr_step_by_step_example.py --cf fedml_config_mpi.yaml
"""

import fedml_perfedavg  # noqa: F401  the one added line: installs Per-FedAvg into FedML

import fedml
from fedml import FedMLRunner

if __name__ == "__main__":
    # init FedML framework
    args = fedml.init()

    # init device
    device = fedml.device.get_device(args)

    # load data
    dataset, output_dim = fedml.data.load(args)

    # load model
    model = fedml.model.create(args, output_dim)

    # start training
    fedml_runner = FedMLRunner(args, device, dataset, model)
    fedml_runner.run()
