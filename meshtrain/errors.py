"""Errors the CLI prints as one line, without a traceback, and the checks of config values
that raise them: whoever owns a config key (a config section, a model's own config) checks
it with these, so every message names the key and the value alike."""

from __future__ import annotations

import difflib
import math


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the field and the fix (exit 2)."""


class TrainingError(RuntimeError):
    """A run stopped by one of its own safeguards (non-finite losses, ...). The message names
    the step and the fix (exit 1)."""


# How gloo and NCCL say a peer went away: a rank's reaction to another's failure.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def lost_peer(message: str) -> bool:
    """Whether an error only says that another rank went away (its cause lies there)."""
    return any(s in message for s in _PEER_LOST)


def check_int(value, key: str, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}={value} exceeds the largest supported value {maximum}, far beyond any real "
                          f"model: choose a smaller {key.rsplit('.', 1)[-1]}")


def check_float(value, key: str, minimum: float | None = None, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number")
    if positive and value <= 0:
        raise ConfigError(f"{key}={value} must be positive")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be at least {minimum}")


def check_bool(value, key: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")


def check_choice(value, key: str, choices) -> None:
    """`choices`: the names, as a tuple or as the keys of the owner's table."""
    choices = tuple(choices)
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6) if isinstance(value, str) else []
        nearest = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(choices)}{nearest}")
