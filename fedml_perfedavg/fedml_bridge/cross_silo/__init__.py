"""FedML's cross-silo deployment with a transport that lets no one in.

- ``fedml_perfedavg.net``: what crosses the boundary (the wire format, certificates, the key
  roster, the address file, the connection gate), with no FedML.
- :mod:`.transport`: FedML's gRPC communication manager replaced (mutual TLS, sender bound to
  the peer's certificate, replays dropped, every send with a deadline).
- :mod:`.policy`: deadlines and the minimum of silos, as pure functions.
- :mod:`.server`, :mod:`.client`: the protocol (each a state machine); the server's pieces:
  :mod:`.rounds` (its rounds), :mod:`.awaited` (what a round waits for), :mod:`.membership`
  (which silos take part), :mod:`.roster` (what is known of each), :mod:`.server_sends` (what it sends).
- :mod:`.process`: one process's part of a run through FedML's own initializers.

Nothing here imports FedML at package import; the modules that adapt FedML classes do.
"""

# Log lines other processes wait for (``launch-silo``, tests): here, so reading them imports no FedML.
READY_MESSAGE = "gRPC rank %d listening on %s:%d"  # a rank's port is bound
TRAINING_STARTED = "online; round"  # the server saw every silo come online ("... round R starts")
