"""The errors a user's input causes (config, recipe files, data, output directories), or the machine they run on.

Entry points catch `UserInputError` and print its message as one line on stderr, exit status 2, wherever it is
raised: while loading the config or while building the run. Anything else is a bug and keeps its traceback.
"""


class UserInputError(ValueError):
    """Bad input from the user; the message names the config key, the file (and line) or the value."""


class MachineError(UserInputError):
    """The machine cannot do what the run needs (e.g. start a local Ray cluster in Ray's time); the message says
    what failed and the remedy."""


class ConfigError(UserInputError):
    """A configuration problem; the message names the offending key."""


class DataError(UserInputError):
    """A data file or data set that cannot be used as configured; the message names the file (and line)."""


def require(ok: bool, key: str, msg: str) -> None:
    """Raise ConfigError naming config key `key` unless ok."""
    if not ok:
        raise ConfigError(f"config key '{key}': {msg}")


def require_choice(value, key: str, allowed) -> None:
    """Raise ConfigError naming `key` unless value is one of `allowed` (which the message lists)."""
    require(value in allowed, key, f"got {value!r}; allowed: {', '.join(map(str, allowed))}")
