"""Issue 77: the plugin changes another package's objects in one place. Outside
``fedml_bridge/install.py`` (its install points, and FedML's own classes where a user asks for the
plugin's fixes) no module of the package assigns an attribute of anything it imported; the only
other way is ``bootstrap.replaced``, which swaps a name for the duration of a ``with`` block and
puts it back, and it too is called from the install point alone (docs/fedml.md's table says so). A check
of the source, as ``grep`` would make it, that would fail on a new monkeypatch."""

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.fast

PACKAGE = Path(REPO) / "fedml_perfedavg"
INSTALL = "fedml_bridge/install.py"
# (file, what it assigns): the interpreter's hook, wrapped when a plugin run starts (docs/fedml.md's row)
ALSO = {("stopping.py", "sys.excepthook")}


def _imported(tree: ast.AST) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def changes():
    """(file, what) for each assignment to an attribute of an imported name, each ``setattr`` on
    one, and each call of ``replaced``, in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        imported = _imported(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets = [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else targets
            for target in targets:
                root = _root(target)
                if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in imported:
                    found.append((name, ast.unparse(target)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
                root = _root(node.args[0])
                if node.func.id == "replaced":
                    found.append((name, "replaced"))
                elif node.func.id == "setattr" and isinstance(root, ast.Name) and root.id in imported:
                    found.append((name, f"setattr({ast.unparse(node.args[0])})"))
    return found


def test_another_packages_objects_change_only_at_the_install_point_or_for_a_with_block_named_in_the_docs():
    found = changes()
    outside = sorted({c for c in found if c[0] != INSTALL and c[1] != "replaced"} - ALSO)
    assert outside == [], outside
    assert any(file == INSTALL and what == "fedml.init" for file, what in found)  # the check sees assignments
    table = (Path(REPO) / "docs" / "fedml.md").read_text()
    swapping = sorted({file for file, what in found if what == "replaced"})
    assert swapping == [INSTALL], swapping  # the with-block swaps too: inside fedml.init alone (issue 77)
    assert f"`{INSTALL}` alone" in table
