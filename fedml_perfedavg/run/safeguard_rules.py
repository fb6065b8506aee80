"""The config's checks of FedML's DP, attack and defense sections, added to every config's rules
(:func:`~fedml_perfedavg.run.config.add_rule`) from here, their domain: what secure aggregation
cannot run beside, then FedML's own classes built from the sections on a view of the run (which
imports FedML). Imported with the run layer (``run/__init__.py``), so no config skips them."""

from __future__ import annotations

from ..fedml_bridge import safeguards
from .config import Config, add_rule


def check_safeguards(config: Config) -> None:
    """FedML's sections as FedML would read them, rehearsed; refused beside secure aggregation
    where they need to see one silo's update."""
    if config.enable_secagg:
        safeguards.check_secure_aggregation(config.safeguards)
    safeguards.check(config.safeguards, safeguards.run_facts(config))


add_rule(check_safeguards)
