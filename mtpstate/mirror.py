"""Device mirror: each step's changes reach torch tensors in one asynchronous
copy.

The host arrays stay the source of truth. The step kernels append every
element they change, as (flat position, value), to a staging slot; ``end_step``
ships the slot with two ``non_blocking`` copies (positions int64, values
int32: 12 bytes per changed element) and applies it on the device with one
scatter into a single flat int32 tensor, of which every device tensor is a
view (and, when an engine's token tensor is the target of new requests'
token ids, a second scatter into that tensor, from the same copies). Bytes
per step grow with what changed, not with ``max_num_reqs``; the number of
device operations per step does not grow with anything.

Staging slots form a ring (depth = the engine's number of in-flight steps).
A slot's pinned buffers are refilled only after the event recorded after its
copy has completed: refilling a pinned buffer while a ``non_blocking`` copy
still reads it silently corrupts the device data. The host waits only when
the ring is full.

Every device operation goes through a :class:`mtpstate.devices.DeviceOps`:
CUDA (pinned staging, a copy stream, events), the CPU (the host runs each
operation as issued), or, in tests, a deferred model of a GPU's asynchrony,
on which CI checks the stream and event ordering.
"""

from __future__ import annotations

import numpy as np

from mtpstate import devices
from mtpstate._kernels import slots as T
from mtpstate.errors import StateError

__all__ = ["DeviceMirror", "MIRRORED_FIELDS"]

# host fields the mirror can keep on the device, by state row (num_blocks: the
# rows F_NB + g); block tables are always mirrored
_FIELD_ROWS = {
    "num_computed_tokens": T.F_NCT,
    "num_computed_prefill_tokens": T.F_NCPT,
    "prefill_len": T.F_PREFILL,
    "prompt_len": T.F_PROMPT,
    "max_seq_len": T.F_MAXSEQ,
}
MIRRORED_FIELDS = (*_FIELD_ROWS, "num_blocks")


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised without torch only
        raise StateError("the device mirror needs torch: pip install 'mtpstate[torch]'") from e
    return torch


class _Slot:
    """One staging slot: host buffers, and the event that says the copy that
    read them has completed."""

    def __init__(self, ops, capacity):
        torch = ops.torch
        self.pos = ops.pinned_empty(capacity, torch.int64)
        self.val = ops.pinned_empty(capacity, torch.int32)
        # numpy views of the same memory: the kernels write through these
        self.pos_np = self.pos.numpy()
        self.val_np = self.val.numpy()
        self.addrs = (self.pos.data_ptr(), self.val.data_ptr(), capacity)
        self.event = None


class DeviceMirror:
    """Keeps torch tensors on ``device`` equal to a RequestTable's host arrays.

    Created by ``RequestTable(..., device=...)``; not used directly.

    Parameters
    ----------
    table : RequestTable
    device : str or torch.device
    ring_depth : int
        Staging slots (>= 2): the number of steps whose copies may be in
        flight at once.
    token_ids_on_device : bool
        True: ``token_ids`` is a device tensor, updated like the rest.
        False (CPU only): it stays in host memory, and
        ``device_tensors.token_ids`` is that host tensor. Refused on an
        asynchronous device: the host would write new requests' tokens into
        memory that device work still in flight may read; use
        ``token_ids_target`` there (its writes go through the staged copy).
    staging_capacity : int, optional
        Initial elements per slot; grown on demand.
    fields : sequence of str, optional
        Host fields kept on the device (default: all of
        ``MIRRORED_FIELDS``); a field left out is never staged and its
        ``device_tensors`` entry is None. Block tables are always mirrored.
    engine_lengths : bool
        Also keep ``device_tensors.total_len`` and
        ``device_tensors.engine_num_computed_tokens`` ([max_num_reqs] int32
        each): written by the mirror only when a request is added (its
        prefill length, its num_computed_tokens), as an engine seeds its own
        device copies, which its device code then advances (vLLM's
        ``RequestState.total_len`` / ``num_computed_tokens``).
    token_ids_target : torch.Tensor, optional
        An engine's ``[max_num_reqs, max_model_len]`` int32 tensor that the
        device can write (a device tensor, or pinned host memory mapped into
        the device's address space, as vLLM's UVA ``all_token_ids``): new
        requests' prefill token ids are scattered into it from the step's
        copy, in stream order, instead of into a mirrored ``token_ids``
        (implies ``token_ids_on_device=False``). The table then keeps no
        host copy of the token ids (``RequestTable.token_ids`` is None):
        the target, which can be several GB, is the only one.
    ops : mtpstate.devices.DeviceOps, optional
        The device operations (default: CUDA or CPU by ``device``); tests
        pass a :class:`mtpstate.devices.DeferredOps`.
    """

    def __init__(
        self,
        table,
        device,
        ring_depth: int = 2,
        token_ids_on_device: bool = True,
        staging_capacity=None,
        fields=None,
        engine_lengths: bool = False,
        token_ids_target=None,
        ops=None,
    ):
        torch = _torch()
        self._torch = torch
        self.device = torch.device(device)
        if ring_depth < 2:
            raise ValueError("ring_depth must be >= 2")
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and not torch.cuda.is_available():
            raise StateError(f"device {device!r} requested but CUDA is not available")
        self.ops = ops = devices.ops_for(torch, self.device) if ops is None else ops
        self.table = table
        self.ring_depth = ring_depth
        R, L = table.max_num_reqs, table.max_model_len
        fields = MIRRORED_FIELDS if fields is None else tuple(fields)
        unknown = sorted(set(fields) - set(MIRRORED_FIELDS))
        if unknown:
            raise ValueError(f"unknown mirrored fields {unknown}; choose from {list(MIRRORED_FIELDS)}")
        self.fields = fields
        self.engine_lengths = bool(engine_lengths)
        self._tok_target = None
        if token_ids_target is not None:
            tt = token_ids_target
            if not isinstance(tt, torch.Tensor) or tt.dtype != torch.int32 or tuple(tt.shape) != (R, L):
                raise ValueError(f"token_ids_target must be an int32 tensor of shape ({R}, {L})")
            if not tt.is_contiguous() or tt.device.type != self.device.type:
                raise ValueError(f"token_ids_target must be contiguous and addressable from {self.device}")
            self._tok_target = tt.view(-1)
            token_ids_on_device = False
        elif not token_ids_on_device and ops.asynchronous:
            raise ValueError(
                "token_ids_on_device=False is refused on an asynchronous device: the host would write new "
                "requests' token ids into memory that device work in flight may still read; pass "
                "token_ids_target= (an engine tensor, written through the staged copy) or keep the default"
            )
        self.token_ids_on_device = token_ids_on_device
        self._host_tok_tensor = None
        if not token_ids_on_device and token_ids_target is None:
            self._host_tok_tensor = torch.zeros((R, L), dtype=torch.int32)
        cap = staging_capacity or max(1024, 4 * R)
        self._slots = [_Slot(ops, cap) for _ in range(ring_depth)]
        self._next = 0
        self._open = None
        self._stream = ops.new_stream()  # the copy stream (None: the host runs the copies)
        self._last = {"bytes": 0, "copies": 0}
        self._rows_rings = {}

    # the table asks for these before it allocates its own token_ids
    @property
    def host_token_ids(self):
        return None if self._host_tok_tensor is None else self._host_tok_tensor.numpy()

    @property
    def keeps_host_token_ids(self) -> bool:
        """False when an engine's tensor is the only copy of the token ids."""
        return self._tok_target is None

    def attach(self):
        """Lay out the flat device tensor and copy the current host state
        (once, at construction). Every view handed out starts on a 16-byte
        boundary (engines' kernels may assume it, e.g. vLLM's Triton block
        table loads): per-request rows have a stride of ``max_num_reqs``
        rounded up to 4 elements, and each region starts aligned."""
        torch = self._torch
        t = self.table
        R, L, ng = t.max_num_reqs, t.max_model_len, t.num_groups
        SR = _aligned(R)  # device row stride of the per-request rows
        nrows = T.F_NB + ng
        off = nrows * SR
        offsets = []
        for w in t.max_num_blocks_per_group:
            off = _aligned(off)
            offsets.append(off)
            off += R * w
        t._flat_bt[:] = offsets
        eng_off = -1
        if self.engine_lengths:
            eng_off = off = _aligned(off)
            off += T.ENG_ROWS * SR
        tok_off = -1
        if self.token_ids_on_device:
            tok_off = off = _aligned(off)
            off += R * L
        # per state row (F_*, num_blocks rows included): mirrored or not
        mirrored = [False] * nrows
        for name in self.fields:
            for f in range(T.F_NB, nrows) if name == "num_blocks" else (_FIELD_ROWS[name],):
                mirrored[f] = True
        mask = sum(1 << f for f, on in enumerate(mirrored) if on)
        # (the array entry point's filter: past the state rows, block tables, always)
        self._mirrored_rows = np.array([*mirrored, True], bool)
        ctx = t._ctx
        ctx[T.TB_FLAT_TOK] = tok_off
        ctx[T.TB_FLAT_ENG] = eng_off
        ctx[T.TB_TOK_EXT] = int(self._tok_target is not None)
        ctx[T.TB_STG_FIELDS] = mask
        ctx[T.TB_STG_STRIDE] = SR
        self._row_stride = SR
        # the host state in the device layout, copied once
        host = np.zeros(off, np.int32)
        host[: nrows * SR].reshape(nrows, SR)[:, :R] = t._state
        for o, bt in zip(offsets, t.block_tables):
            host[o : o + bt.size] = bt.reshape(-1)
        if tok_off >= 0:
            host[tok_off : tok_off + R * L] = t.token_ids.reshape(-1)
        self._flat = f = torch.zeros(off, dtype=torch.int32, device=self.device)  # [total elements]
        f.copy_(torch.from_numpy(host))
        rows = f[: nrows * SR].view(nrows, SR)[:, :R]  # [num_fields, max_num_reqs], row stride SR
        per_row = {name: rows[row] if name in self.fields else None for name, row in _FIELD_ROWS.items()}
        eng = f[eng_off : eng_off + T.ENG_ROWS * SR].view(T.ENG_ROWS, SR)[:, :R] if eng_off >= 0 else None
        if tok_off >= 0:
            tokens = f[tok_off : tok_off + R * L].view(R, L)
        elif self._tok_target is not None:
            tokens = self._tok_target.view(R, L)
        else:
            tokens = self._host_tok_tensor
        self.tensors = _Tensors(
            **per_row,
            num_blocks=rows[T.F_NB :] if "num_blocks" in self.fields else None,  # [num_groups, max_num_reqs]
            block_tables=[f[o : o + R * w].view(R, w) for o, w in zip(offsets, t.max_num_blocks_per_group)],
            token_ids=tokens,
            total_len=None if eng is None else eng[T.ENG_TOTAL_LEN],
            engine_num_computed_tokens=None if eng is None else eng[T.ENG_NCT],
        )
        for name, v in vars(self.tensors).items():
            for x in v if isinstance(v, list) else (v,):
                if x is not None and not (name == "token_ids" and self._tok_target is not None):  # (the engine's)
                    assert x.data_ptr() % 16 == 0, f"device view {name} is not 16-byte aligned"
        self._alloc_device_buffers(len(self._slots[0].pos))

    def _alloc_device_buffers(self, cap):
        torch = self._torch
        self._dev_pos = self.ops.empty(cap, torch.int64)
        self._dev_val = self.ops.empty(cap, torch.int32)

    # -- per step ------------------------------------------------------------

    def begin_step(self):
        """Point the kernels at a free staging slot (waiting only if the ring
        is full)."""
        if self._open is None:
            slot = self._slots[self._next]
            if slot.event is not None:
                self.ops.host_wait(slot.event)  # its copy may still be reading it
                slot.event = None
            self._open = slot
            ctx = self.table._ctx
            ctx[T.TB_STG_POS], ctx[T.TB_STG_VAL], ctx[T.TB_STG_CAP] = slot.addrs
            ctx[T.TB_STG_ON] = 1
        self.table._cv[T.TB_STG_N] = 0

    def abort_step(self):
        """Close a step that will ship nothing (rejected, or already ended)."""
        if self._open is not None:
            self._open = None
            self.table._cv[T.TB_STG_ON] = 0

    def end_step(self, n: int, n_tok: int = 0, deduplicate: bool = False):
        """Ship the first ``n`` staged elements of the open slot (of which
        the first ``n_tok`` are token ids for the token target) and scatter
        them into the device tensors; returns without waiting."""
        if n == 0:  # nothing to ship: the slot stays open for the next step
            self.table._cv[T.TB_STG_N] = 0
            self._last = _SHIPPED_NOTHING
            return
        slot = self._open
        self._open = None
        self._next = (self._next + 1) % len(self._slots)
        self.table._cv[T.TB_STG_ON] = 0  # nothing is staged between steps
        if deduplicate:  # the same element written twice in one step: keep the last write
            p = slot.pos_np[n_tok:n][::-1]
            _, first = np.unique(p, return_index=True)
            keep = n_tok + np.sort(n - n_tok - 1 - first)
            m = n_tok + len(keep)
            slot.pos_np[n_tok:m] = slot.pos_np[keep]
            slot.val_np[n_tok:m] = slot.val_np[keep]
            n = m
        ops, stream = self.ops, self._stream
        consumer = ops.current_stream()
        # the copy must not overtake device work already queued on the
        # consumer's stream that reads these tensors
        ops.wait_stream(stream, consumer)
        with ops.on_stream(stream):
            self._ship(slot, n, n_tok)
        slot.event = ops.record_event(stream)
        # the consumer's later work sees the update, without a host wait
        ops.wait_stream(consumer, stream)
        self._last = {"bytes": n * (8 + 4), "copies": 2}

    def _ship(self, slot, n, n_tok):
        """The step's device work: two copies, one scatter per target."""
        ops = self.ops
        dpos = self._dev_pos[:n]
        dval = self._dev_val[:n]
        ops.copy(dpos, slot.pos[:n])
        ops.copy(dval, slot.val[:n])
        if n > n_tok:
            ops.scatter(self._flat, dpos[n_tok:], dval[n_tok:])
        if n_tok:
            ops.scatter(self._tok_target, dpos[:n_tok], dval[:n_tok])

    def stage_arrays(self, staged):
        """Stage changes made outside the kernels (the array entry point):
        (flat positions, values) pairs; fields not mirrored are dropped."""
        pos = np.concatenate([np.asarray(p, np.int64) for p, _ in staged])
        val = np.concatenate([np.asarray(v, np.int32) for _, v in staged])
        rows = self._mirrored_rows
        keep = rows[np.minimum(pos // self._row_stride, len(rows) - 1)]
        pos, val = pos[keep], val[keep]
        self.begin_step()
        if len(pos) > len(self._open.pos_np):
            self.grow_staging(len(pos))
        self._open.pos_np[: len(pos)] = pos
        self._open.val_np[: len(val)] = val
        self.end_step(len(pos))

    def grow_staging(self, need: int):
        """Reallocate every slot (and the device buffers) to hold ``need``."""
        self.synchronize()
        cap = max(need, 2 * len(self._slots[0].pos))
        self._slots = [_Slot(self.ops, cap) for _ in range(len(self._slots))]
        self._alloc_device_buffers(cap)
        if self._open is not None:
            self._open = None
            self.begin_step()

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
            ring = self._rows_rings[purpose] = _RowsRing(self.ops, self.table.max_num_reqs, self.ring_depth)
        return ring

    def synchronize(self):
        for slot in self._slots:
            slot.event = None
        for ring in self._rows_rings.values():
            ring.events = [None] * ring.depth
        self.ops.synchronize()

    def stats(self) -> dict:
        return dict(self._last)


_SHIPPED_NOTHING = {"bytes": 0, "copies": 0}


def _aligned(n: int) -> int:
    """``n`` int32 elements rounded up to a 16-byte boundary."""
    return (n + 3) // 4 * 4


class _RowsRing:
    """Pinned host buffers and device buffers for a per-step int64 row
    mapping, used round robin; an event per buffer guards its refill."""

    def __init__(self, ops, capacity, depth):
        self.ops = ops
        torch = ops.torch
        self.host = [ops.pinned_empty(capacity, torch.int64) for _ in range(depth)]
        self.host_np = [h.numpy() for h in self.host]
        # on the CPU the host buffers are the result
        self.dev = [ops.empty(capacity, torch.int64) for _ in range(depth)] if ops.asynchronous else None
        self.events = [None] * depth
        self.next = 0
        self.depth = depth
        self.capacity = capacity

    def upload(self, rows):
        k = self.next
        self.next = (k + 1) % self.depth
        n = len(rows)
        if n > self.capacity:
            raise StateError(f"{n} rows exceed max_num_reqs={self.capacity}")
        ev = self.events[k]
        if ev is not None:
            self.ops.host_wait(ev)  # its last copy may still be reading the buffer
            self.events[k] = None
        self.host_np[k][:n] = rows
        if self.dev is None:
            return self.host[k][:n]
        out = self.dev[k][:n]
        ops = self.ops
        # on the mirror device's current stream (not the current device's)
        stream = ops.current_stream()
        ops.copy(out, self.host[k][:n])
        self.events[k] = ops.record_event(stream)
        return out


class _Tensors:
    """The device tensors, with the host arrays' names and shapes."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    def __repr__(self):
        return f"DeviceTensors({', '.join(self.__dict__)})"
