"""User-facing errors: one exception type for every mistake a user can fix by editing config."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting (or a combination of settings) is invalid.

    The message names the offending key and says how to fix it. The CLI prints it without a
    traceback (unless ``HYDRA_FULL_ERROR=1``) and exits with status 2, before any process group,
    data loading or training starts.
    """


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds.

    Used from config dataclasses' ``__post_init__`` so validation reads as a list of rules.
    """
    if not condition:
        raise ConfigError(message)
