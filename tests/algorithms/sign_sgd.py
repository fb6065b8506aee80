"""A test-only algorithm, one file: local steps follow the sign of the gradient."""

import torch
from torch.func import grad

from fedml_perfedavg.algorithms import FederatedAlgorithm, register


class SignSGD(FederatedAlgorithm):
    name = "SignSGD"  # its settings: every method's beta and tau; none of its own

    def local_update(self, params, batches):
        grad_fn = grad(self.loss_fn)
        for t in range(batches.x.shape[0]):
            g = grad_fn(params, batches.x[t], batches.y[t])
            params = {k: params[k] - self.settings.beta * torch.sign(g[k]) for k in params}
        return params


register("SignSGD", SignSGD)
