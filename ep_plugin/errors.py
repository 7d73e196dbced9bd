"""Exceptions of ep_plugin. Input errors subclass ValueError/TypeError so callers can catch either."""


class ConfigError(ValueError):
    """A configuration file or dict is invalid; the message names the file, key and allowed values."""


class BackendUnavailableError(RuntimeError):
    """A backend was asked for that is not built or cannot run here; the message says how to get it."""


class EPTimeoutError(TimeoutError):
    """A communication step waited longer than comm.timeout_s; `missing_ranks` did not arrive."""

    def __init__(self, message: str, missing_ranks=()):
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)
