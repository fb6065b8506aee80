"""The plugin's own command line, ``fedml-perfedavg`` and ``python -m fedml_perfedavg``: a process
the plugin owns from its start, unlike a FedML user's script that imports the plugin.

Only here does the plugin make the process's start cheaper by changing what it imports
(:mod:`.import_cost`: FedML's heavy imports deferred to their first use, the imported heap frozen,
TorchDynamo loaded at its first real use); a user's own program that imports ``fedml_perfedavg``
gets FedML and torch exactly as they are (issue 77).
"""

from .import_cost import take_process

take_process()

from .run.cli import main  # noqa: E402  (after the process is taken: the command line imports FedML)

__all__ = ["main"]
