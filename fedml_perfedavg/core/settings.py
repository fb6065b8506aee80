"""How a setting is declared: a dataclass field with its type, default, allowed values, rule and
help text, in a YAML section of FedML's. The run's config (:mod:`fedml_perfedavg.run.config`)
declares its sections this way, and so does each algorithm its own settings (an algorithm's
``Settings`` dataclass): the config, its docs table and the cross-silo fingerprint read them
all alike. Nothing here imports FedML.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import field
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

from .errors import ConfigError

Rule = Tuple[Callable[[Any], bool], str]

POSITIVE: Rule = (lambda v: v > 0, "> 0")
AT_LEAST_ONE: Rule = (lambda v: v >= 1, ">= 1")
NON_NEGATIVE: Rule = (lambda v: v >= 0, ">= 0")
EVEN: Rule = (lambda v: v >= 2 and v % 2 == 0, "an even number >= 2")


def setting(
    kind: type,
    default: Any,
    help: str,
    choices: Optional[Sequence[Any]] = None,
    rule: Optional[Rule] = None,
    optional: bool = False,
    section: Optional[str] = None,
) -> Any:
    """A dataclass field that is a setting: ``kind`` its YAML type, ``choices`` or ``rule`` what
    is allowed, ``help`` its line in the docs table; ``section`` its YAML section (or set by
    :func:`in_section` on the class)."""
    metadata = {
        "kind": kind,
        "help": help,
        "choices": tuple(choices) if choices else None,
        "check": rule[0] if rule else None,
        "rule": rule[1] if rule else "",
        "optional": optional,
    }
    if section is not None:
        metadata["section"] = section
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def in_section(name: str) -> Callable[[type], type]:
    """Declares a class of :func:`setting` fields as YAML section ``name`` (applied before
    ``@dataclass``, while the fields are still class attributes)."""

    def declare(cls: type) -> type:
        for value in vars(cls).values():
            if isinstance(value, dataclasses.Field):
                value.metadata = MappingProxyType({**value.metadata, "section": name})
        return cls

    return declare


def suggest(name: str, candidates: Iterable[str]) -> str:
    """ "; did you mean X?" for the closest candidate (case-insensitive), or ""."""
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.75)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def field_default(f: "dataclasses.Field[Any]") -> Any:
    """A setting's default (its value, or a fresh one from its factory)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    factory = f.default_factory
    if not callable(factory):
        raise TypeError(f"setting {f.name!r} has no default")
    return factory()


def check_value(f: dataclasses.Field, value: Any) -> Any:
    """``value`` as setting ``f`` allows it (an int for a float widened, a choice as its owner's
    typed value), or :class:`ConfigError` naming ``section.key=value`` and what is allowed."""
    meta = f.metadata
    kind = meta["kind"]
    where = f"{meta['section']}.{f.name}={value!r}"
    if value is None:
        if meta["optional"]:
            return None
        raise ConfigError(f"{where}: a value is required ({meta['help']})")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is float and isinstance(value, str):
        # PyYAML follows YAML 1.1, where 1e-3 (no dot) is a string, not a number.
        try:
            value = float(value)
        except ValueError:
            pass
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(f"{where}: must be of type {kind.__name__} ({meta['help']})")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number")
    if meta["choices"] is not None:
        if value not in meta["choices"]:
            allowed = [str(c) for c in meta["choices"]]
            raise ConfigError(f"{where}: must be one of {allowed}{suggest(str(value), allowed)}")
        value = next(c for c in meta["choices"] if c == value)  # the owner's typed value (a Step), kept from here on
    if meta["check"] is not None and not meta["check"](value):
        raise ConfigError(f"{where}: must be {meta['rule']}")
    return value


def declaration(f: dataclasses.Field) -> Dict[str, Any]:
    """What a setting means, for comparing two declarations of one key: its kind, default,
    choices, rule, whether it may be null, and its section (not its help text)."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    meta = f.metadata
    return {
        "kind": getattr(meta.get("kind"), "__name__", meta.get("kind")),
        "default": default,
        "choices": meta.get("choices"),
        "rule": meta.get("rule"),
        "optional": meta.get("optional"),
        "section": meta.get("section"),
    }


def settings_of(cls: Optional[type]) -> Tuple[dataclasses.Field, ...]:
    """The setting fields of a settings dataclass (none for None)."""
    if cls is None:
        return ()
    return tuple(f for f in dataclasses.fields(cls) if "kind" in f.metadata)


def check_settings(values: Any) -> None:
    """:class:`ConfigError` for the first field of a settings dataclass instance that its
    declaration does not allow (an algorithm's own settings built in code, not by the config)."""
    for f in settings_of(type(values)):
        check_value(f, getattr(values, f.name))
