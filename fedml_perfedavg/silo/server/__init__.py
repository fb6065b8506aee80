"""The cross-silo server's protocol, with no I/O and no FedML: events in, actions out.

- :mod:`.protocol`: the server as one state machine (``handle(event) -> actions``); :mod:`.events`
  its events and actions.
- :mod:`.agreement`: what silos announce and must agree on; :mod:`.modes` where the data lives (the
  protocol's half of the run's data mode); :mod:`.policy` deadlines and the fewest silos.
- :mod:`.rounds` its rounds, :mod:`.awaited` what a round waits for, :mod:`.membership` which silos
  take part, :mod:`.roster` what is known of each, :mod:`.phases` the open phase and its deadline.
- :mod:`.secure_rounds`, :mod:`.secure_evaluation`: secure aggregation's stages on the server
  (the silo's are :mod:`fedml_perfedavg.silo.secure`; both drive ``fedml_perfedavg.secagg``).
- :mod:`.readiness`: the server's state file for a launcher.

FedML's face of it, and the gRPC transport, are ``fedml_bridge/cross_silo``.
"""

# Log lines other processes wait for (``launch-silo``, tests): here, so reading them imports no FedML.
READY_MESSAGE = "gRPC rank %d listening on %s:%d"  # a rank's port is bound
TRAINING_STARTED = "online; round"  # the server saw every silo come online ("... round R starts")
