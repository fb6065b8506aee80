"""The plugin's errors, one hierarchy for every layer: what the command line turns into exit
statuses and what a user's script may catch."""


class ConfigError(ValueError):
    """A setting has a value the plugin cannot run with; the message names the key, the value
    and what is allowed."""


class DivergenceError(RuntimeError):
    """Local training produced non-finite values and the policy is to stop."""


class RunStopped(RuntimeError):
    """The run cannot go on (too many rounds without an acceptable update, lost silos, ...)."""


class OutputError(RuntimeError):
    """A run's file cannot be written (a full or read-only disk, a missing folder, ...); the
    message names the file, the folder and the cause."""


class SiloFailure(RunStopped):
    """Cross-silo: a peer did not answer in time and the failure policy says stop."""
