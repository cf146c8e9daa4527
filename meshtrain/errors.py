"""Errors a user can cause. The CLI prints these without a traceback and exits 2."""


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the field and the fix."""
