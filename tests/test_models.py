import torch

from fedml_perfedavg.models import MLP, SmallCNN, create_model


def test_paper_mlp_shapes_and_elu():
    model = create_model("mlp", (1, 28, 28), 10)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(layer.in_features, layer.out_features) for layer in linear] == [(784, 80), (80, 60), (60, 10)]
    assert sum(isinstance(m, torch.nn.ELU) for m in model.modules()) == 2
    assert create_model("mlp", (3, 32, 32), 10).net[1].in_features == 3072
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_cnn_option():
    model = create_model("small_cnn", (3, 32, 32), 10)
    assert isinstance(model, SmallCNN) and model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert isinstance(create_model("mlp", (1, 28, 28), 10, hidden=(5,)), MLP)
