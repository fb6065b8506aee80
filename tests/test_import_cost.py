"""Imports deferred to first use (import_cost.ImportDeferral): on made-up packages, then on FedML."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap

import pytest

from fedml_perfedavg.import_cost import ImportDeferral

HEAVY = """
LOADS = __import__("os").environ.get("HEAVY_LOADS")
if LOADS:
    open(LOADS, "a").write("loaded\\n")
VALUE = 42
class Base:
    pass
class Thing(Base):
    pass
def make():
    return Thing()
"""

IMPORTER_MODULE = """
import heavy_pkg
from heavy_pkg import make, Base
from heavy_pkg.part import half
import other_importer

class Local(Base):  # a base class: the real one, loaded here
    pass

def value():
    return heavy_pkg.VALUE

def built():
    return make()
"""


@pytest.fixture()
def packages(tmp_path, monkeypatch):
    """``importer_pkg`` (defers), ``heavy_pkg`` (deferred, counts its loads), ``other_importer``
    (a plain module that imports heavy_pkg too)."""
    (tmp_path / "heavy_pkg").mkdir()
    (tmp_path / "heavy_pkg" / "__init__.py").write_text(HEAVY)
    (tmp_path / "heavy_pkg" / "part.py").write_text("def half():\n    return 21\n")
    (tmp_path / "importer_pkg").mkdir()
    (tmp_path / "importer_pkg" / "__init__.py").write_text("")
    (tmp_path / "importer_pkg" / "uses.py").write_text(IMPORTER_MODULE)
    (tmp_path / "importer_pkg" / "light.py").write_text("import heavy_pkg\nfrom heavy_pkg import make\n")
    (tmp_path / "other_importer.py").write_text("import heavy_pkg\nSEEN = heavy_pkg.VALUE\n")
    loads = tmp_path / "loads.txt"
    monkeypatch.setenv("HEAVY_LOADS", str(loads))
    monkeypatch.syspath_prepend(str(tmp_path))
    deferral = ImportDeferral(["heavy_pkg"], "importer_pkg")
    sys.meta_path.insert(0, deferral)
    yield loads
    sys.meta_path.remove(deferral)
    for name in list(sys.modules):
        if name.split(".")[0] in ("heavy_pkg", "importer_pkg", "other_importer"):
            del sys.modules[name]


@pytest.mark.fast
def test_a_deferred_package_loads_at_the_first_use_of_a_name(packages):
    light = importlib.import_module("importer_pkg.light")
    assert not packages.exists() and "heavy_pkg" not in sys.modules  # imported, not loaded
    assert repr(light.make) == "<deferred heavy_pkg.make>"
    inspect.getmodule(light)  # probes every module's __file__: loads nothing
    assert not packages.exists()
    thing = light.make()
    assert type(thing).__name__ == "Thing" and packages.read_text() == "loaded\n"
    assert light.heavy_pkg.VALUE == 42 and isinstance(thing, light.heavy_pkg.Base)
    assert sys.modules["heavy_pkg"].make is light.make._real()  # the one real module, loaded once
    assert packages.read_text() == "loaded\n"


@pytest.mark.fast
def test_other_importers_base_classes_and_functions_get_the_real_objects(packages):
    uses = importlib.import_module("importer_pkg.uses")
    # other_importer's top-level code read heavy_pkg.VALUE: it got the real module, loaded once,
    # and the class body's base class is the real Base
    assert sys.modules["other_importer"].SEEN == 42 and packages.read_text() == "loaded\n"
    real = sys.modules["heavy_pkg"]
    assert uses.Local.__mro__[1] is real.Base and uses.half() == 21
    assert uses.value() == 42 and isinstance(uses.built(), real.Thing)
    assert isinstance(uses.built(), uses.Base) and issubclass(uses.Local, uses.Base)


@pytest.mark.fast
def test_after_the_import_the_stand_ins_leave_sys_modules(packages):
    light = importlib.import_module("importer_pkg.light")
    assert "heavy_pkg" not in sys.modules
    import heavy_pkg  # noqa: F401  a later importer: the real package

    assert packages.read_text() == "loaded\n" and not hasattr(sys.modules["heavy_pkg"], "_deferral_")
    assert light.make() is not None and packages.read_text() == "loaded\n"


@pytest.mark.backend
def test_import_fedml_loads_none_of_what_it_defers_and_fedml_still_reaches_it():
    """The plugin's command line (``fedml_perfedavg.command``, which takes the process), then
    ``import fedml``, in a fresh interpreter: none of the deferred packages is loaded
    (torchvision would bring torch._dynamo), and FedML's names for them reach the real objects:
    torchvision's transforms (the DLG attack), scipy (FedML's RDP accountant), wandb."""
    code = textwrap.dedent(
        """
        import sys
        import fedml_perfedavg.command, fedml
        from fedml_perfedavg.fedml_bridge.bootstrap import _FEDML_DEFERS
        tops = {name.split(".")[0] for name in _FEDML_DEFERS if not name.startswith("fedml.")}
        print(sorted(tops & {name.split(".")[0] for name in sys.modules}), "torch._dynamo" in sys.modules)
        from fedml.core.security.attack import dlg_attack
        from fedml.core.dp.budget_accountant import rdp_analysis
        from fedml.core.mlops import stats_impl
        import torchvision.transforms, scipy.special, wandb
        print(dlg_attack.transforms.ToTensor is torchvision.transforms.ToTensor,
              rdp_analysis.special.gammaln(3.0) == scipy.special.gammaln(3.0),
              stats_impl.wandb.util is wandb.util)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[] False", "True True True"], out


@pytest.mark.backend
def test_torch_func_gradients_do_not_load_torchdynamo_and_torchdynamo_still_works():
    """torch.func's every gradient reads torch._dynamo.compiled_autograd (1.0 s of CPU to import
    TorchDynamo at the first one, in every process that trains). In the plugin's own process, the
    gradients (plain and under vmap) are autograd's and TorchDynamo stays unloaded; ``import
    torch._dynamo``, any other name of it and torch.compile get the real package, after which the
    gradients go through its own switch."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        import fedml_perfedavg.command  # the plugin's own command line: it owns the process
        from torch.func import functional_call, grad, vmap
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ELU(), torch.nn.Linear(5, 3))
        params = {k: v.detach() for k, v in model.named_parameters()}
        x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
        def loss(p, x, y):
            return torch.nn.functional.cross_entropy(functional_call(model, p, (x,)), y)
        g = grad(loss)(params, x, y)
        per_user = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.view(2, 2, 6), y.view(2, 2))
        wanted = torch.autograd.grad(loss(dict(model.named_parameters()), x, y), list(model.parameters()))
        same = all(torch.equal(g[k], w) for k, w in zip(params, wanted))
        print("torch._dynamo" in sys.modules, same, tuple(per_user["0.weight"].shape))
        config = type(torch._dynamo.config).__name__
        print(config, "torch._dynamo" in sys.modules, torch._dynamo is sys.modules["torch._dynamo"])
        double = torch.compile(lambda t: 2 * t, backend="eager")
        again = grad(loss)(params, x, y)
        print(torch.equal(double(x), 2 * x), all(torch.equal(again[k], g[k]) for k in g))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert lines[:3] == ["False True (2, 5, 6)", "ConfigModuleInstance True True", "True True"], out.stdout


@pytest.mark.backend
def test_a_fedml_users_program_that_imports_the_plugin_gets_fedml_and_torch_as_they_are():
    """Issue 77: ``import fedml_perfedavg, fedml`` in a user's program defers nothing, freezes no
    heap and leaves torch._dynamo alone: what FedML imports is loaded as without the plugin."""
    code = textwrap.dedent(
        """
        import gc, sys, types
        import fedml_perfedavg, fedml
        import torch
        from fedml_perfedavg.fedml_bridge.bootstrap import _FEDML_DEFERS
        from fedml_perfedavg.import_cost import owns_process
        tops = {name.split(".")[0] for name in _FEDML_DEFERS if not name.startswith("fedml.")}
        stand_ins = [n for n, m in list(sys.modules.items()) if n.split(".")[0] == "fedml" and m is not None
                     and any(type(v).__module__ == "fedml_perfedavg.import_cost" for v in vars(m).values())]
        print(owns_process(), gc.get_freeze_count() == 0, stand_ins, "torchvision" in sys.modules,
              type(torch.__dict__.get("_dynamo")).__module__ != "fedml_perfedavg.import_cost")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[0] == "False True [] True True", out.stdout


@pytest.mark.fast
def test_another_fedml_release_is_refused_at_install_in_one_line():
    """Issue 77: install checks FedML's version and refuses any other, naming the supported one,
    before it changes anything in FedML."""
    from fedml_perfedavg.fedml_bridge.install import SUPPORTED_FEDML, UnsupportedFedML, check_fedml_version

    check_fedml_version(SUPPORTED_FEDML)
    with pytest.raises(UnsupportedFedML) as refused:
        check_fedml_version("0.8.7")
    (line,) = str(refused.value).splitlines()
    assert line.startswith("fedml-perfedavg supports FedML 0.9.6 only; this process imports FedML 0.8.7")


@pytest.mark.backend  # a fresh process: the plugin installs itself when FedML comes
def test_a_process_with_another_fedml_release_stops_at_import_naming_both():
    import subprocess
    import sys

    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '0.8.7' if name == 'fedml' else real(name)\n"
        "import fedml_perfedavg\n"
        "import fedml\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith(
        "UnsupportedFedML: fedml-perfedavg supports FedML 0.9.6 only; this process imports FedML 0.8.7 "
        "(pip install fedml==0.9.6); nothing in FedML was changed"
    ), done.stderr[-2000:]
