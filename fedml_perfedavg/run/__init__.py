"""The run layer: typed config (:mod:`.config`), the staged runner (:mod:`.runner`),
checkpoints, reporting, the command line (:mod:`.cli`) and the cross-silo launcher."""
