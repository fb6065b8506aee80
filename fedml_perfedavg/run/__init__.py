"""The run layer: typed config (:mod:`.config`), the staged runner (:mod:`.runner`),
checkpoints, reporting, the command line (:mod:`.cli`) and the cross-silo launcher."""

from . import safeguard_rules  # noqa: F401  every config is checked against FedML's safeguard sections
