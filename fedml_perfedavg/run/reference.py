"""docs/configuration.md's table, generated from the config's schema (:mod:`.schema`)."""

from __future__ import annotations

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
    return "\n".join(rows)
