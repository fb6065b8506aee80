"""The FedML-free core: Per-FedAvg's maths in plain PyTorch (``torch.func``).

- :mod:`.client_maths`: meta-gradient estimators (fo, hf, exact) and the local update;
- :mod:`.hand_batched`: the same gradients for a chain of Linear layers, every client at once;
- :mod:`.evaluation`: the personalized evaluation protocol;
- :mod:`.sampling`: client sampling and minibatches keyed by (seed, round, client, purpose);
- :mod:`.guards`: checks of local training and of received client updates;
- :mod:`.privacy`, :mod:`.private_draws`, :mod:`.private_steps`, :mod:`.adaptive_clipping`,
  :mod:`.ledger`, :mod:`.accounting`: DP-SGD (its settings; Poisson minibatches and noise; per-sample
  clipping in the local step; the adaptive clip bound; each user's uses; the accountants);
- :mod:`.stationarity`: the paper's ``||grad F(w)||^2``, exactly;
- :mod:`.functional`: how any ``nn.Module`` is run as a pure function of its parameters;
- :mod:`.errors`, :mod:`.types`: the errors every layer raises and the shared types.

Nothing here imports FedML.
"""
