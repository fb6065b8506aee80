"""docs/configuration.md's table, generated from the config's schema (:mod:`.schema`) and, for
``dp_args`` (FedML's section, read as DP-SGD's where ``dp_solution_type`` is dpsgd), from
core/privacy.py's :class:`~fedml_perfedavg.core.privacy.DPSGD` and its ``KEY_DOCS``."""

from __future__ import annotations

import dataclasses

from ..core.privacy import DPSGD, KEY_DOCS, KEYS
from ..core.settings import field_default
from .schema import settings


def markdown_table(builtin_only: bool = False) -> str:
    """docs/configuration.md's table (``builtin_only``: the built-in algorithms' keys alone), or
    this process's, with the keys of algorithms registered in it, generated from :class:`Config`."""
    rows = ["| section | key | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for f in settings(builtin_only):
        meta = f.metadata
        default = field_default(f)
        if meta["choices"]:
            allowed = ", ".join(map(str, meta["choices"]))
        elif meta["rule"]:
            allowed = meta["rule"] + (" or null" if meta["optional"] else "")
        else:
            allowed = meta["kind"].__name__ + (" or null" if meta["optional"] else "")
        rows.append(f"| {meta['section']} | `{f.name}` | `{default}` | {allowed} | {meta['help']} |")
    defaults = {f.name: f.default for f in dataclasses.fields(DPSGD)}
    for key in KEYS:
        allowed, meaning = KEY_DOCS[key]
        default = defaults.get(key, dataclasses.MISSING)
        shown = "(none)" if default is dataclasses.MISSING else f"`{default}`"
        rows.append(f"| dp_args | `{key}` | {shown} | {allowed} | {meaning} |")
    return "\n".join(rows)
