"""What crosses a process boundary in a cross-silo run, with no FedML and no protocol state: the
message format and the peers' identities, read strictly as untrusted input.

- :mod:`.wire`: messages as data (JSON header + safetensors), never a pickle; the size cap.
- :mod:`.credentials`: the run CA, each rank's certificate, the rank a peer's certificate names.
- :mod:`.key_roster`: the run's key roster, every rank's key as its party made it.
- :mod:`.addresses`: FedML's gRPC address file, read strictly; ports a launcher may choose.
- :mod:`.gate`: the connection caps in front of gRPC (per address, in total, silent ones first out).
- :mod:`.refusals`: refusals counted and logged at a bounded rate.

The gRPC transport that uses them, and FedML's managers around it, are ``fedml_bridge/cross_silo``.
"""
