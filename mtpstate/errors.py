"""Errors raised on bad input. Every one is a :class:`StateError`, and a call
that raises one has changed nothing."""

from __future__ import annotations

__all__ = [
    "StateError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "CapacityError",
    "InvalidStepError",
]


class StateError(ValueError):
    """Base of every error mtpstate raises on bad input.

    The state (index, host arrays, staging) is exactly as it was before the
    call that raised it.
    """


class UnknownRequestError(StateError, KeyError):
    """A request id that is not live where a live one is required."""

    def __init__(self, req_id, detail: str = ""):
        self.req_id = req_id
        msg = f"unknown request id {req_id!r}"
        super().__init__(msg + (f": {detail}" if detail else ""))

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class DuplicateRequestError(StateError):
    """An id given twice where ids must be unique, or inserted while live."""


class CapacityError(StateError):
    """More requests than free rows."""


class InvalidStepError(StateError):
    """A malformed scheduler step: a bad count, length, block id or type."""
