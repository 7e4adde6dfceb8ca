"""What a bounded wait raises, and how long it waits: the errors and the timeout setting that
``presence`` (every collective's wait) and ``agreement`` (the store meetings) share. Below both,
so neither imports the other for them."""

from __future__ import annotations

import os

DEFAULT_TIMEOUT = 60.0
TIMEOUT_ENV = "ZEROKIT_COLLECTIVE_TIMEOUT"


class AgreementError(RuntimeError):
    """The ranks differ on something they must share; the same message on every rank."""


class CollectiveTimeout(AgreementError, TimeoutError):
    """Some ranks of the group did not make the call within the timeout."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing  # global ranks


def collective_timeout(timeout: float | None = None) -> float:
    """Seconds to wait for the other ranks: ``timeout``, else ``$ZEROKIT_COLLECTIVE_TIMEOUT``,
    else 60."""
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV)
        try:
            timeout = float(text) if text else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"${TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if not timeout > 0:
        raise ValueError(
            f"the collective timeout must be a positive number of seconds, got {timeout}"
        )
    return float(timeout)
