"""Errors. Bad input raises a :class:`StateError`, and a call that raises one
has changed nothing; a device fault after a step was applied raises a
:class:`MirrorFaultError`."""

from __future__ import annotations

__all__ = [
    "StateError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "CapacityError",
    "InvalidStepError",
    "MirrorFaultError",
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
    """More requests than free rows, or a step that stages more than a
    device mirror's ``staging_capacity``."""


class InvalidStepError(StateError):
    """A malformed scheduler step: a bad count, length, block id or type."""


class MirrorFaultError(RuntimeError):
    """The device work of a step failed (a failed or interrupted launch)
    *after* the step was applied to the host arrays. Not a
    :class:`StateError`: the host state did change, so the step must not be
    applied again.

    ``stale`` says whether some of the step's device work was never queued:
    then the device tensors are stale until the next call (``apply``,
    ``synchronize``) has waited for the device, rewritten every region the
    host holds and issued the rest (each operation once); until that
    succeeds every such call raises this error and changes nothing. False:
    all of it was queued, and the next call only waits for the device
    before it reuses the staging. A device that fails while the mirror
    waits for it is unusable (a sticky error): every later call raises this
    error, saying so."""

    stale = True
