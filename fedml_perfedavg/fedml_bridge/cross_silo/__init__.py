"""FedML's cross-silo deployment with a transport that lets no one in: what touches FedML or gRPC.

- :mod:`.transport`: FedML's gRPC communication manager replaced (mutual TLS, sender bound to
  the peer's certificate, replays dropped, every send with a deadline); :mod:`.delivery` sending.
- :mod:`.server`, :mod:`.client`: FedML's managers as thin faces of the protocols, which have no
  I/O and no FedML (``fedml_perfedavg.silo.server`` the server's, ``fedml_perfedavg.silo`` the
  silo's); :mod:`.server_sends` carries out the server's sends.
- :mod:`.process`: one process's part of a run through FedML's own initializers.
- :mod:`.backends`: FedML's other backends refused for a cross-silo run.
- What crosses the boundary (the wire format, certificates, the key roster, the address file, the
  connection gate) is ``fedml_perfedavg.net``, with no FedML.

Nothing here imports FedML at package import; the modules that adapt FedML classes do.
"""

# Log lines other processes wait for (``launch-silo``, tests), defined with the protocol that logs them.
from ...silo.server import READY_MESSAGE, TRAINING_STARTED  # noqa: F401
