"""The folders tell the architecture: the core, data, algorithms and engine never import FedML
or the run layer; the FedML bridge never imports the run layer; no import cycles, including
imports inside functions; the layers are the ones docs/architecture.md lists."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fedml_perfedavg"
FEDML_FREE = ("core", "secagg", "net", "data", "algorithms", "silo", "engine", "models", "logs", "stopping")
LAYERS = {
    "core": 0,
    "secagg": 0,
    "models": 0,
    "logs": 0,
    "stopping": 0,
    "data": 1,
    "net": 1,
    "algorithms": 2,
    "silo": 2,
    "engine": 3,
    "fedml_bridge": 3,
    "run": 4,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """Every module ``path`` imports, anywhere in the file (absolute names)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            yield name
            yield from (f"{name}.{alias.name}" for alias in node.names)


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}, modules


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "package"


def test_fedml_free_folders_never_import_fedml_or_the_layers_above():
    graph, modules = _graph()
    for module, path in modules.items():
        area = _area(module)
        if area not in LAYERS:
            continue
        external = set(_imports(path))
        if area in FEDML_FREE:
            assert not any(i == "fedml" or i.startswith("fedml.") for i in external), module
        for target in graph[module]:
            if _area(target) in LAYERS and target.split(".")[1] != "__init__":
                assert LAYERS[_area(target)] <= LAYERS[area] or _area(target) == area, f"{module} imports {target}"


def test_the_architecture_page_lists_the_layers_this_test_checks():
    """docs/architecture.md's numbered layers name each area (``core/``, ``models.py``) at the layer
    LAYERS gives it, and every area of LAYERS once."""
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    listed = {}
    for number, names in re.findall(r"^(\d)\. \*\*[^*]+\*\* \(([^)]*)\)", page, flags=re.MULTILINE):
        for name in re.findall(r"`([a-z_]+)(?:/|\.py)`", names):
            assert name not in listed, f"{name} listed twice"
            listed[name] = int(number)
    assert listed == LAYERS


def test_no_import_cycles_between_modules():
    graph, modules = _graph()
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in graph[node]:
            if target in packages and node.startswith(target + "."):
                continue  # a module importing from its own package's __init__ (which re-exports it)
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(target) :] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _fresh_interpreter(code: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.backend  # fresh interpreters, one of them importing FedML
def test_the_core_imports_without_fedml_and_the_plugin_installs_itself_when_fedml_comes():
    loaded = (
        "import sys; print(sorted(m for m in ('fedml', 'grpc') if m in sys.modules), "
        "sys.modules['fedml_perfedavg.fedml_bridge.install'].is_installed() "
        "if 'fedml_perfedavg.fedml_bridge.install' in sys.modules else None)"
    )
    assert _fresh_interpreter(
        f"import fedml_perfedavg.core, fedml_perfedavg.algorithms, fedml_perfedavg.data; {loaded}"
    ) in ("[] None", "[] False")
    # The one line a FedML user adds, before or after `import fedml`: installed either way.
    # (installing changes nothing of FedML's transport, so grpc stays out: a plugin run's managers
    # import the secured transport themselves; issue 77)
    installed = "['fedml'] True"
    assert _fresh_interpreter(f"import fedml_perfedavg; {loaded}; import fedml; {loaded}") == f"[] False\n{installed}"
    assert _fresh_interpreter(f"import fedml; import fedml_perfedavg; {loaded}") == installed
    # FedML first imported by a module of the plugin, half-made then: installed at FedML's first use.
    first_use = f"""
import types
import fedml_perfedavg.fedml_bridge.cross_silo.transport as transport
import fedml
from fedml.core.distributed.communication.grpc import grpc_comm_manager
{loaded}
try:
    fedml.FedMLRunner(types.SimpleNamespace(), None, None, None)
except Exception:
    pass  # the installed FedMLRunner then refuses these empty arguments
{loaded}
print(grpc_comm_manager.GRPCCommManager is transport.SecureGRPCCommManager)
"""
    # FedML's own transport stays FedML's (common_args.plugin_fixes would replace it)
    assert _fresh_interpreter(first_use) == "['fedml', 'grpc'] False\n['fedml', 'grpc'] True\nFalse"
