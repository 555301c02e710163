"""What a shipped step hands out on the device: its batch's ``idx_mapping``,
``query_start_loc`` / ``cu_num_logits`` and expanded logits, as views made
once per size; and row uploads through rings of persistent pinned buffers."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import slots as T
from mtpstate.errors import StateError


class _Views:
    """The device side of a step's results, and row uploads."""

    def presize_views(self) -> None:
        """Make now the device views :meth:`idx_mapping` and
        :meth:`batch_inputs` hand out, for every batch size and slot, so that
        no step pays for making one (an engine whose batch size changes every
        step would otherwise make several per step until it has seen every
        size)."""
        R = self.table.max_num_reqs
        for slot in self._slots:
            if slot.didx is not None:
                for n in range(R + 1):
                    slot.idx_views.setdefault(n, slot.didx[:n])
            if slot.dcu is not None:
                for n in range(R + 1):
                    slot.cu_views.setdefault(n, slot.dcu[: n + 1])
        if self._local_pos_zeros is not None:
            for n in range(R + 1):
                self._zero_views.setdefault(n, self._local_pos_zeros[:n])

    def idx_mapping(self):
        """The last shipped step's batch ``idx_mapping`` on the device (int64,
        one view per size, made once)."""
        slot, n = self._idx_slot, self._idx_n
        if slot is None:
            raise StateError("no step has shipped a batch yet")
        v = slot.idx_views.get(n)
        if v is None:
            v = slot.idx_views[n] = slot.didx[:n]
        return v

    def batch_inputs(self):
        """The last shipped step's device inputs: (``query_start_loc`` (the
        target, whole), ``cu_num_logits[:n + 1]``, int32 zeros ``[:n]``),
        views made once per size."""
        slot, n = self._idx_slot, self._idx_n
        if slot is None:
            raise StateError("no step has shipped a batch yet")
        cu = slot.cu_views.get(n)
        if cu is None:
            cu = slot.cu_views[n] = slot.dcu[: n + 1]
        z = self._zero_views.get(n)
        if z is None:
            z = self._zero_views[n] = self._local_pos_zeros[:n]
        return self._qsl_target, cu, z

    def expanded_inputs(self):
        """The last shipped step's ``(expanded_idx_mapping,
        expanded_local_pos)`` on the device (``num_logits`` entries each),
        views made once per size; None where the step kernel left them to
        the engine (``BatchReqState.expanded_idx_mapping_np`` is None)."""
        slot = self._idx_slot
        if slot is None:
            raise StateError("no step has shipped a batch yet")
        cv = self.table._cv
        if not cv[T.TB_B_EXP_OK]:
            return None
        m = cv[T.TB_B_NUM_LOGITS]
        v = slot.exp_views.get(m)
        if v is None:
            R = self.table.max_num_reqs
            v = slot.exp_views[m] = (slot.didx[R : R + m], slot.dcu[R + 1 : R + 1 + m])
        return v

    def stage_arrays(self, staged):
        """Stage changes made outside the kernels (the array entry point,
        checked against the capacity before it wrote: ``check_staged``):
        (flat positions, values) pairs; fields not mirrored are dropped."""
        pos = np.concatenate([np.asarray(p, np.int64) for p, _ in staged])
        val = np.concatenate([np.asarray(v, np.int32) for _, v in staged])
        rows = self._mirrored_rows
        keep = rows[np.minimum(pos // self._row_stride, len(rows) - 1)]
        pos, val = pos[keep], val[keep]
        self.begin_step()
        area = self._open.state
        area.pos_np[: len(pos)] = pos
        area.val_np[: len(val)] = val
        self.end_step(len(pos), results=False)

    def upload_rows(self, rows: np.ndarray, purpose: str = "rows"):
        """``rows`` (row numbers, e.g. a batch -> row mapping) as an int64
        tensor on the device, through a ring of persistent pinned buffers
        per ``purpose`` (no pinned allocation per call): one non-blocking
        copy on the current stream, each buffer refilled only after its last
        copy completed. The result is valid until ``ring_depth`` more calls
        with the same ``purpose``."""
        return self.rows_ring(purpose).upload(rows)

    def rows_ring(self, purpose: str = "rows") -> _RowsRing:
        """The ring ``upload_rows`` uses for ``purpose`` (a caller that
        uploads every step keeps it and calls its ``upload``)."""
        ring = self._rows_rings.get(purpose)
        if ring is None:
            self._usable("making a row upload ring")
            ring = self._rows_rings[purpose] = _RowsRing(self, self.table.max_num_reqs, self.ring_depth)
            self._held.append(ring)
        return ring

    def current_stream(self):
        """The consumer's current stream (the one known from the last step
        when it has not changed: no lookup)."""
        ops = self.ops
        if ops.stream_key() == self._stream_key:
            return self._stream
        return ops.current_stream()


class _RowsRing:
    """Pinned host buffers and device buffers for a per-step int64 row
    mapping, used round robin; an event per buffer (made once) guards its
    refill."""

    def __init__(self, mirror, capacity, depth):
        ops = self.ops = mirror.ops
        self.mirror = mirror
        torch = ops.torch
        self.host = [mirror._pinned(capacity, torch.int64) for _ in range(depth)]
        self.host_np = [h.numpy() for h in self.host]
        # on the CPU the host buffers are the result
        self.dev = [mirror._device(capacity, torch.int64) for _ in range(depth)] if ops.asynchronous else None
        self.events = [ops.new_event() for _ in range(depth)]
        self.pending = [False] * depth
        self.next = 0
        self.depth = depth
        self.capacity = capacity

    def wait_idle(self, ops) -> None:
        for k in range(self.depth):
            if self.pending[k]:
                ops.host_wait(self.events[k])
                self.pending[k] = False

    def drained(self) -> None:
        """The device has run everything queued: nothing reads the buffers now."""
        self.pending = [False] * self.depth

    def upload(self, rows):
        mirror = self.mirror
        mirror._usable("upload_rows")
        k = self.next
        n = len(rows)
        if n > self.capacity:
            raise StateError(f"{n} rows exceed max_num_reqs={self.capacity}")
        self.next = (k + 1) % self.depth
        if self.pending[k]:
            try:
                self.ops.host_wait(self.events[k])  # its last copy may still be reading the buffer
            except Exception as e:
                mirror._unusable(e)
            self.pending[k] = False
        self.host_np[k][:n] = rows
        if self.dev is None:
            return self.host[k][:n]
        out = self.dev[k][:n]
        ops = self.ops
        # on the mirror device's current stream (not the current device's)
        ops.copy(out, self.host[k][:n])
        ops.record(self.events[k], mirror.current_stream())
        self.pending[k] = True
        return out
