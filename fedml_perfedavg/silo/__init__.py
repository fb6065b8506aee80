"""A silo's side of the cross-silo protocol, FedML-free and with no I/O: what a data owner's silo
keeps of a run (:mod:`.outcome`) and the rules its own process enforces whatever the server asks
(:mod:`.rules`): which rounds it trains and evaluates, how often its data is used, which survivor
lists it reveals shares for. The FedML-facing silo (fedml_bridge/cross_silo/client.py) asks these
rules before it trains, evaluates or unmasks, so a test drives them with lists of events alone."""
