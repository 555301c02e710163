"""When the device fails: a step's device work that failed part way is kept
(the operations not yet queued, the token ids not yet shipped) and issued by
the next call after it has waited for the device and rewritten every region
the host holds, so no operation runs twice; a device that fails to
synchronize is unusable (a sticky error) and every later call says so."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import slots as T
from mtpstate._kernels.tokens import tok_fill
from mtpstate.errors import MirrorFaultError, StateError
from mtpstate.mirror.layout import _host_scatter


class _Fault:
    """What a failed step left to do: the operations of its slot's work not
    yet queued (from ``done`` on), and the token ids of its chunks not yet
    queued (kept here: apply's token objects are gone by the next call)."""

    def __init__(self, slot, n, m, nn, done, slot_done, tokens):
        self.slot, self.n, self.m, self.nn = slot, n, m, nn  # the slot's work (see _slot_work)
        self.done = done  # its operations queued
        self.slot_done = slot_done  # all of them
        self.tokens = tokens  # (positions int64, values int32) or None

    @property
    def stale(self) -> bool:
        return not self.slot_done or self.tokens is not None


class _Faults:
    """The mirror's fault handling: refusing calls on a closed or lost
    device, keeping what a failed step left, and issuing it again."""

    def _usable(self, what: str) -> None:
        """Refuse a call on a closed or unusable mirror, or while the current
        stream is capturing (our operations would land in the engine's
        graph): before any device call. (The CPU captures nothing.)"""
        if self._blocked:
            self._refuse(what)
        if self.asynchronous and self.ops.capturing():
            raise StateError(_capturing(what))

    def _refuse(self, what: str) -> None:
        if self._closed:
            raise StateError(f"{what}: the table's device mirror was closed")
        raise MirrorFaultError(self._lost)

    def _failed(self, e, fault, n_tok):
        """A step's device work failed: keep what was not queued (its token
        ids past the last queued chunk copied out of apply's objects), raise."""
        if self._shipped < n_tok:
            rest = n_tok - self._shipped
            pos, val = np.empty(rest, np.int64), np.empty(rest, np.int32)
            nruns = self.table._cv[T.TB_RES_NN]
            tok_fill(
                self.table._ix_addr, self._tok_runs_addr, nruns, self._shipped, rest, pos.ctypes.data, val.ctypes.data
            )
            fault.tokens = (pos, val)
        self._fault = fault
        if not isinstance(e, Exception):  # an interrupt: as it is
            raise e
        if self._lost is not None:  # (a wait found the device unusable)
            raise MirrorFaultError(self._lost) from e
        if self._fault.stale:
            detail = (
                "not all of the step's device work was queued: the device tensors are stale until the next call "
                "(apply, synchronize) issues the rest"
            )
        else:
            detail = (
                "the step's device work was queued, but not the event that guards its staging: the next call "
                "waits for the device first"
            )
        err = MirrorFaultError(
            f"device mirror: {e!r} while shipping a step to {self.device}; the step was applied to the host "
            f"arrays (do not apply it again); {detail}"
        )
        err.stale = self._fault.stale
        raise err from e

    def resync(self):
        """Finish what a failed step left: wait for the device, rewrite every
        region that has a host copy (idempotent), then issue the step's
        operations that were never queued and its token ids that were not
        (so no operation runs twice: the engine's lengths and the new rows'
        zeroing are seeded once, whatever the device did since). Raises
        :class:`~mtpstate.MirrorFaultError` if that fails too (what is left
        stays for the next call)."""
        f = self._fault
        if f is None:
            return
        self._usable("resynchronizing the device mirror")
        self._drain()
        if f.stale:
            ops = self.ops
            try:
                for o, a in self._host_regions():
                    ops.copy(self._flat[o : o + a.size], self._torch.from_numpy(a.copy()))
                if not f.slot_done:
                    self._done = f.done
                    try:
                        self._slot_work(f.slot, f.n, f.m, f.nn, f.done)
                    finally:
                        f.done = self._done
                    f.slot_done = True
                if f.tokens is not None:
                    self._ship_kept_tokens(*f.tokens)
                    f.tokens = None
            except Exception as e:
                raise MirrorFaultError(
                    f"device mirror: {e!r} while resynchronizing after a failed step; the device tensors are stale; "
                    "the next call tries again"
                ) from e
            self._drain()
        self._fault = None

    def _ship_kept_tokens(self, pos, val):
        """A failed step's token ids kept on the host, through the overflow
        ring's chunks (idle: the caller drained), a chunk at a time."""
        for start in range(0, len(pos), self._tcap):
            a = self._chunks[0].tokens  # (token ids are kept only past a slot's token area: the ring exists)
            m = min(self._tcap, len(pos) - start)
            a.pos_np[:m] = pos[start : start + m]
            a.val_np[:m] = val[start : start + m]
            if self.path == "host":
                _host_scatter(self._tok_np, a, m)
            else:
                self._issue(self._eager_scatter(a, m, self._dtok, self._tok_dst, None))
            self.ops.synchronize()

    @property
    def stale(self) -> bool:
        """True after a step's device work failed before all of it was
        queued, until a call issues the rest."""
        return self._fault is not None and self._fault.stale

    def _drain(self):
        """Wait until every queued operation has run: no slot or row buffer
        is read by the device any more. A device that cannot is unusable."""
        try:
            self.ops.synchronize()
        except Exception as e:
            self._unusable(e)
        for g in self._held:
            if hasattr(g, "drained"):  # (slots, chunks, row rings; not the device areas)
                g.drained()

    def _unusable(self, e):
        self._blocked = True
        self._lost = (
            f"device mirror: the device {self.device} is unusable ({e!r} while waiting for it: a sticky device "
            "error, which every later device call reports until the process recreates its device context); "
            "the host arrays hold every applied step; the device tensors are not current; build a new table "
            "on a working device"
        )
        raise MirrorFaultError(self._lost) from e


def _capturing(what: str) -> str:
    return (
        f"{what} while the current stream is capturing a CUDA graph: refused before any allocation, copy or "
        "event record, so the capture stays valid; call it before or after the engine's capture"
    )
