"""The FedML-free core: Per-FedAvg's maths in plain PyTorch (``torch.func``).

- :mod:`.algorithm`: meta-gradient estimators (fo, hf, exact) and the local update;
- :mod:`.evaluation`: the personalized evaluation protocol;
- :mod:`.sampling`: client sampling and minibatches keyed by (seed, round, client, purpose);
- :mod:`.guards`: checks of local training and of received client updates;
- :mod:`.functional`: how any ``nn.Module`` is run as a pure function of its parameters;
- :mod:`.types`: the shared types.

Nothing here imports FedML.
"""
