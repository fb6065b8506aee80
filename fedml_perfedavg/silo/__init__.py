"""Both sides of the cross-silo protocol, FedML-free and with no I/O; the server's is :mod:`.server`.

A silo's side: its states, deadlines and
answers to the server as one object (:mod:`.protocol`, events in and actions out: :mod:`.events`),
what a data owner's silo keeps of a run (:mod:`.outcome`) and the rules its own process enforces
whatever the server asks (:mod:`.rules`): which rounds it trains and evaluates, how often its data is
used, which survivor lists it reveals shares for, and its secure-aggregation stages (:mod:`.secure`;
the messages both sides write: :mod:`.secure_messages`). The FedML-facing silo
(fedml_bridge/cross_silo/client.py) is a thin adapter that turns FedML's messages into events and
carries out the actions, so tests drive the silo with lists of events alone (tests/silo/)."""
