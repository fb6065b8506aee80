"""A silo's side of the cross-silo protocol, FedML-free and with no I/O: its states, deadlines and
answers to the server as one object (:mod:`.protocol`, events in and actions out: :mod:`.events`),
what a data owner's silo keeps of a run (:mod:`.outcome`) and the rules its own process enforces
whatever the server asks (:mod:`.rules`): which rounds it trains and evaluates, how often its data is
used, which survivor lists it reveals shares for. The FedML-facing silo
(fedml_bridge/cross_silo/client.py) is a thin adapter that turns FedML's messages into events and
carries out the actions, so tests drive the silo with lists of events alone (tests/silo/)."""
