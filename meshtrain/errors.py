"""Errors the CLI prints as one line, without a traceback."""


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the field and the fix (exit 2)."""


class TrainingError(RuntimeError):
    """A run stopped by one of its own safeguards (non-finite losses, ...). The message names
    the step and the fix (exit 1)."""
