"""What importing torch and FedML costs a process, made smaller (issue 54).

- The collector paused (:func:`collector_paused`): the imports create a few hundred thousand
  objects that live as long as the process and almost no garbage, while the collector, triggered
  by allocation counts, walks the growing heap again and again. Paused, with what survives frozen
  afterwards (``gc.freeze``), ``import fedml_perfedavg, fedml`` took 2.1 s of user CPU instead
  of 4.1 on the project's machine.
- Imports deferred (:class:`ImportDeferral`): FedML's modules import torchvision (and with it
  torch._dynamo), wandb, scipy, pandas, sqlalchemy, docker and more at ``import fedml``, for
  MLOps, schedulers and other datasets' loaders; deferred to their first use, the same import
  takes 1.0 s of user CPU instead of 2.2. fedml_bridge/bootstrap.py names what is deferred.
- TorchDynamo not loaded by torch.func (:func:`dynamo_on_first_use`): the first gradient of every
  process imported all of it (1.0 s of CPU) to switch off compiled autograd, which is off unless
  TorchDynamo is loaded; a one-round quick-start run took 2.1 s of CPU instead of 3.4.

Every process of a run (each cross-silo rank, each MPI rank) pays these at start. They change
what the process imports, so they apply only where the plugin owns the process: its own command
line (:mod:`fedml_perfedavg.command` calls :func:`take_process`), never a FedML user's program
that imports the plugin (issue 77). Nothing here imports anything beyond the standard library, so
it can come first.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from typing import Any, Iterable, Iterator, Optional


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Run the block with the collector off, then restore it as it was (nested uses leave it to
    the outermost). ``freeze``: first freeze every object there is, as the modules just imported
    live as long as the process. No collection runs first: with the collector off, every object
    the imports made is in the youngest generation, so one collection walks all of them (0.45 s
    of CPU here); the price is that garbage cycles already made when FedML is first imported
    stay (import the plugin and FedML at the top of a program, as usual, and there are none to
    speak of)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if freeze:
                gc.freeze()
            gc.enable()


_OWN_PROCESS = False


def take_process() -> None:
    """The plugin's own command line owns this process: FedML's import is made cheaper here
    (:func:`owns_process`), and torch.func's gradients do not load TorchDynamo until it is used."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    torch = sys.modules.get("torch")
    if torch is not None:
        dynamo_on_first_use(torch)


def owns_process() -> bool:
    """Whether the plugin's own command line started this process (:func:`take_process`)."""
    return _OWN_PROCESS


_IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


def _asking_module_level(depth: int) -> str:
    """The module whose top-level code (its own or a class body's) runs ``depth`` frames up, the
    import system's frames skipped; "" if a function's code runs there."""
    frame: Optional[types.FrameType] = sys._getframe(depth + 1)
    while frame is not None and frame.f_code.co_filename in _IMPORT_MACHINERY:
        frame = frame.f_back
    if frame is None or frame.f_code.co_flags & inspect.CO_OPTIMIZED:  # a function's frame
        return ""
    return str(frame.f_globals.get("__name__", ""))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


class ImportDeferral(importlib.abc.MetaPathFinder):
    """While one of ``importer``'s modules runs its top-level code, what it imports from
    ``packages`` is a stand-in: nothing of the package is loaded until a name from it is first
    used (called, subclassed, read from), by anyone. Every other importer, and the importer's
    own functions, get the real modules; the stand-ins leave ``sys.modules`` as soon as the
    importer's outermost module has run, so a later ``import`` of the package loads it.

    A name imported from a deferred module stays a stand-in where it was bound: fine for classes,
    functions and modules, which are called, subclassed or read from, but not for values used
    as such (``from p import LIMIT``; ``LIMIT * 2`` fails). Defer only packages from which the
    importer imports no values."""

    def __init__(self, packages: Iterable[str], importer: str) -> None:
        self.packages = tuple(packages)
        self.importer = importer
        self.depth = 0  # importer's modules running their top-level code, nested

    def _deferred_package(self, name: str) -> Optional[str]:
        return next((package for package in self.packages if _within(name, package)), None)

    def defers_for(self, depth: int) -> bool:
        """Whether the code ``depth`` frames up gets stand-ins."""
        return self.depth > 0 and _within(_asking_module_level(depth + 1), self.importer)

    def find_spec(self, name, path=None, target=None):
        package = self._deferred_package(name)
        if package is not None and self.defers_for(1):
            return importlib.util.spec_from_loader(name, _StandInLoader(self), is_package=True)
        if package is not None and isinstance(sys.modules.get(package), _StandInModule):
            parent = self.load(name.rpartition(".")[0]) if "." in name else None  # a part, for another importer
            path = getattr(parent, "__path__", None)
        if name.startswith(self.importer + "."):  # the package itself: see deferring()
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _DeferringLoader(spec.loader, self)
            return spec
        if package is not None and path is not None:
            return importlib.machinery.PathFinder.find_spec(name, path)
        return None

    def load(self, name: str) -> Any:
        """The real module ``name``: its package's stand-ins leave ``sys.modules`` first."""
        package = self._deferred_package(name)
        if package is not None:
            self.drop_stand_ins(package)
        return importlib.import_module(name)

    @staticmethod
    def drop_stand_ins(package: str = "") -> None:
        for name, module in list(sys.modules.items()):
            if isinstance(module, _StandInModule) and (not package or _within(name, package)):
                del sys.modules[name]

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """The importer's modules' top-level code in this block defers (the finder runs each of
        its modules in one; the importer's package itself is left to the other finders, which
        may have a loader of their own for it, so its first import belongs in one)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.drop_stand_ins()


class _DeferringLoader(importlib.abc.Loader):
    """The importer's own loader, its module's top-level code run with the deferral on."""

    def __init__(self, loader: Any, deferral: ImportDeferral) -> None:
        self.loader, self.deferral = loader, deferral

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # its own, for resource readers
        with self.deferral.deferring():
            self.loader.exec_module(module)


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, deferral: ImportDeferral) -> None:
        self.deferral = deferral

    def create_module(self, spec):
        return _StandInModule(spec.name, self.deferral)

    def exec_module(self, module) -> None:
        pass


class _StandInModule(types.ModuleType):
    """A deferred module: to top-level code of the importer its attributes are stand-ins, to
    everyone else the real module's."""

    def __init__(self, name: str, deferral: ImportDeferral) -> None:
        super().__init__(name)
        self.__path__: list = []  # a package as far as the import system knows: parts come here too
        self._deferral_ = deferral

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute not in _DUNDERS_OF_THE_REAL_MODULE:
            raise AttributeError(attribute)  # inspect and others probe __file__ and the like
        if not attribute.startswith("__") and self._deferral_.defers_for(1):
            return _StandIn(self.__name__, attribute, self._deferral_)
        return _resolve(self._deferral_, self.__name__, attribute)


_DUNDERS_OF_THE_REAL_MODULE = ("__all__", "__version__")


def _resolve(deferral: ImportDeferral, module: str, attribute: str) -> Any:
    real = deferral.load(module)
    try:
        return getattr(real, attribute)
    except AttributeError:
        if attribute.startswith("__"):
            raise
        return deferral.load(f"{module}.{attribute}")  # a submodule its package does not import


_UNRESOLVED = object()


class _StandIn:
    """A name imported from a deferred module (``from wandb import util``): the real object at
    its first use, be it a call, an attribute, a base class or an ``isinstance``."""

    __slots__ = ("_module", "_attribute", "_deferral", "_real_object")

    def __init__(self, module: str, attribute: str, deferral: ImportDeferral) -> None:
        self._module, self._attribute, self._deferral = module, attribute, deferral
        self._real_object: Any = _UNRESOLVED

    def _real(self) -> Any:
        if self._real_object is _UNRESOLVED:
            self._real_object = _resolve(self._deferral, self._module, self._attribute)
        return self._real_object

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self._real()[key]

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (self._real(),)

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, self._real())

    def __subclasscheck__(self, subclass: Any) -> bool:
        return issubclass(subclass, self._real())

    def __repr__(self) -> str:
        return f"<deferred {self._module}.{self._attribute}>"


_deferrals: dict = {}


def imports_deferred(packages: Iterable[str], importer: str) -> ImportDeferral:
    """Install (once per importer, for the life of the process) an :class:`ImportDeferral`."""
    if importer not in _deferrals:
        _deferrals[importer] = ImportDeferral(packages, importer)
        sys.meta_path.insert(0, _deferrals[importer])
    return _deferrals[importer]


# -- torch._dynamo, read by torch.func at every gradient --------------------------------------------
class _DynamoUntilUsed(types.ModuleType):
    """``torch._dynamo`` as an attribute of ``torch`` until something of it is used: reading any
    name but ``compiled_autograd`` imports the real package (which makes itself the attribute)."""

    def __getattr__(self, name: str) -> Any:
        if name == "compiled_autograd":
            return _COMPILED_AUTOGRAD_UNTIL_USED
        if name.startswith("__") and name not in _DUNDERS_OF_THE_REAL_MODULE:
            raise AttributeError(name)
        return getattr(importlib.import_module("torch._dynamo"), name)


class _CompiledAutogradUntilUsed(types.ModuleType):
    @staticmethod
    def _disable() -> Any:
        """Compiled autograd is switched on only through torch._dynamo itself: while that is not
        loaded there is nothing to switch off; once it is, its own ``_disable``."""
        real = sys.modules.get("torch._dynamo.compiled_autograd")
        return real._disable() if real is not None else contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name not in _DUNDERS_OF_THE_REAL_MODULE:
            raise AttributeError(name)
        return getattr(importlib.import_module("torch._dynamo.compiled_autograd"), name)


_COMPILED_AUTOGRAD_UNTIL_USED = _CompiledAutogradUntilUsed("torch._dynamo.compiled_autograd")
_DYNAMO_DEFERRED_FOR = ("2.13.",)  # torch versions whose torch.func reads it so (checked on each)


def dynamo_on_first_use(torch_module: Any) -> bool:
    """Every ``torch.func.grad`` enters ``torch._dynamo.compiled_autograd._disable()`` around its
    ``autograd.grad`` (torch/_functorch/eager_transforms.py, ``_autograd_grad``), and reading
    ``torch._dynamo`` imports all of TorchDynamo: 1.0 s of CPU at the first gradient of every
    process that trains (each cross-silo rank, each MPI rank), for a switch that is off unless
    TorchDynamo was loaded. Until then, ``torch._dynamo`` is :class:`_DynamoUntilUsed` (never in
    ``sys.modules``: ``import torch._dynamo``, ``torch.compile`` and any other name of it load
    the real package, which replaces the stand-in). True if installed."""
    if not str(getattr(torch_module, "__version__", "")).startswith(_DYNAMO_DEFERRED_FOR):
        return False
    if "torch._dynamo" in sys.modules or "_dynamo" in vars(torch_module):
        return False
    torch_module._dynamo = _DynamoUntilUsed("torch._dynamo")
    return True
