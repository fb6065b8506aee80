"""The FedML-free core: Per-FedAvg's maths in plain PyTorch (``torch.func``).

- :mod:`.client_maths`: meta-gradient estimators (fo, hf, exact) and the local update;
- :mod:`.hand_batched`: the same gradients for a chain of Linear layers, every client at once;
- :mod:`.evaluation`: the personalized evaluation protocol;
- :mod:`.sampling`: client sampling and minibatches keyed by (seed, round, client, purpose);
- :mod:`.guards`: checks of local training and of received client updates;
- :mod:`.privacy`: DP-SGD (Poisson minibatches, per-sample clipping and noise, the accountant);
- :mod:`.stationarity`: the paper's ``||grad F(w)||^2``, exactly;
- :mod:`.functional`: how any ``nn.Module`` is run as a pure function of its parameters;
- :mod:`.errors`, :mod:`.types`: the errors every layer raises and the shared types.

Nothing here imports FedML.
"""
