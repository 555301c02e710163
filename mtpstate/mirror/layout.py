"""Where the mirror's values live on the device, and what a step stages.

One flat int32 device tensor holds every mirrored value: the per-request
state rows (row stride ``max_num_reqs`` rounded up to 4 elements), each KV
group's block table, the engine's own lengths and the token ids when they
are mirrored; every device tensor handed out is a view of it, starting on a
16-byte boundary. A step stages (flat position, value) pairs into pinned
areas of a slot; the slots, the overflow ring's chunks and the device
buffers they are copied into are made once, when the table is built.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import slots as T
from mtpstate._kernels.tokens import tok_fill
from mtpstate.errors import StateError
from mtpstate.results import input_views

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

META = T.STG_META  # int64 header of an area's positions buffer: [live elements, 0]
BUCKET0 = 256  # smallest size bucket; each next one is 4x larger, the last the capacity
TOKEN_CHUNK = 1 << 18  # default token ids per slot and per overflow chunk (at least max_model_len)
OVERFLOW_CHUNKS = 2  # chunks of the ring that carries a step's token ids past its slot's token area

# kinds of step, one graph each per slot and bucket
V_PLAIN = 0  # the staged elements (+ idx_mapping)
V_NEW = 1  # + the new rows zeroed in the engine's tensors
V_TOK = 2  # + the token area scattered into the token target (one graph per token bucket)


def bucket_sizes(cap: int) -> list[int]:
    """Padded sizes of the staged elements: 256, 1024, ... below ``cap``, then ``cap``."""
    sizes, s = [], BUCKET0
    while s < cap:
        sizes.append(s)
        s *= 4
    return [*sizes, cap]


def bucket_of(n: int, last: int) -> int:
    """The smallest bucket (index into :func:`bucket_sizes`) that holds ``n``."""
    return min(max(0, ((n - 1).bit_length() - 7) // 2), last)


def step_capacity(max_num_reqs: int, num_groups: int, max_num_blocks_per_group) -> int:
    """Elements other than token ids that one step can stage: every row
    added (its state fields and engine lengths, a full block table per
    group) and every row updated (two counts and a num_blocks per group).
    A new request carries its whole block list, which prefix caching makes
    independent of the tokens scheduled, so the bound is the block tables'
    width, not ``max_num_batched_tokens``. (Only a row re-sent as resumed in
    the step that added it can stage more: such a step is refused.)"""
    R = max_num_reqs
    return R * (T.F_NB + num_groups + T.ENG_ROWS) + R * (2 + num_groups) + R * sum(max_num_blocks_per_group)


def _aligned(n: int) -> int:
    """``n`` int32 elements rounded up to a 16-byte boundary."""
    return (n + 3) // 4 * 4


def _host_scatter(dst_np, area, n):
    """The CPU: the host writes the device tensors (the same memory)."""
    dst_np[area.pos_np[:n]] = area.val_np[:n]


class _Area:
    """Pinned host buffers for staged (position, value) elements: positions
    int64 after a META header, values int32; views made once per bucket.
    ``pos``, ``val``: views of buffers shared with another area (a slot's
    token area follows its elements: the kernels find it there)."""

    def __init__(self, mirror, capacity, pos=None, val=None):
        torch = mirror._torch
        self.pos = mirror._pinned(META + capacity, torch.int64) if pos is None else pos  # [META + cap]
        self.val = mirror._pinned(capacity, torch.int32) if val is None else val  # [cap]
        pos = self.pos.numpy()
        pos[:] = 0
        self.val.numpy()[:] = 0
        self.meta_np = pos[:META]
        # numpy views of the same memory: the kernels write through these
        self.pos_np = pos[META:]
        self.val_np = self.val.numpy()
        self.addrs = (self.pos.data_ptr() + 8 * META, self.val.data_ptr(), capacity)
        self.capacity = capacity
        self.sizes = bucket_sizes(capacity)
        self.views = [(self.pos[: META + b], self.val[:b]) for b in self.sizes]  # (positions + header, values)

    def bucket(self, n: int) -> int:
        return bucket_of(n, len(self.sizes) - 1)


class _DeviceArea:
    """The device buffers an area is copied into before its scatter; one per
    kind of area, shared by every slot (the replays run in stream order)."""

    def __init__(self, mirror, capacity):
        torch = mirror._torch
        self.pos = mirror._device(META + capacity, torch.int64)
        self.val = mirror._device(capacity, torch.int32)
        # per bucket: (positions + header, positions, values)
        self.views = [(self.pos[: META + b], self.pos[META : META + b], self.val[:b]) for b in bucket_sizes(capacity)]


class _Guarded:
    """Buffers the device may still read until ``event`` completes."""

    event = None
    pending = False  # the event was recorded after work that reads these buffers

    def wait_idle(self, ops) -> None:
        if self.pending:
            ops.host_wait(self.event)
            self.pending = False

    def drained(self) -> None:
        """The device has run everything queued: nothing reads these now."""
        self.pending = False


class _Slot(_Guarded):
    """One staging slot: the step's elements and token area, its batch
    idx_mapping and new rows (pinned, with their device copies), the event
    that says the slot's last replay has completed, and its graphs by
    (kind of step, bucket[, token bucket])."""

    def __init__(self, mirror, capacity, tok_capacity, R, idx, rows, inputs, num_logits=0):
        torch = mirror._torch
        # one buffer each for positions and values: the elements, then the token area
        pos = mirror._pinned(META + capacity + (META + tok_capacity if tok_capacity else 0), torch.int64)
        val = mirror._pinned(capacity + tok_capacity, torch.int32)
        self.state = _Area(mirror, capacity, pos[: META + capacity], val[:capacity])
        self.tokens = _Area(mirror, tok_capacity, pos[META + capacity :], val[capacity:]) if tok_capacity else None
        # [R + num_logits]: the batch's idx_mapping, then (with inputs) its
        # expanded_idx_mapping, shipped together
        E = num_logits if inputs else 0
        self.idx = mirror._pinned(R + E, torch.int64) if idx else None
        self.rows = mirror._pinned(R, torch.int64) if rows else None  # [R]: new rows, padded
        for b in (self.idx, self.rows):
            if b is not None:
                b.numpy()[:] = 0
        self.idx_np = None if self.idx is None else self.idx.numpy()
        self.rows_np = None if self.rows is None else self.rows.numpy()
        self.event = mirror.ops.new_event()
        self.graphs = {}  # key -> (graph, the captured work, which holds its tensors)
        if mirror.ops.asynchronous:  # per slot: idx_mapping must outlive the step (ring_depth steps)
            self.didx = mirror._device(R + E, torch.int64) if idx else None
            self.drows = mirror._device(R, torch.int64) if rows else None
        else:  # the host runs the work: the staged buffers are the device side
            self.didx, self.drows = self.idx, self.rows
        self.idx_views = {}  # n -> the device idx_mapping[:n] (made once per size)
        # the step's inputs for the forward (T.BI_*, then expanded_local_pos),
        # written there by the kernel: query_start_loc is shipped, and
        # cu_num_logits with expanded_local_pos (one contiguous copy)
        self.inputs = self.inputs_np = self.dcu = None
        if inputs:
            S = R + 1
            self.inputs = mirror._pinned(T.BI_ROWS * S + E, torch.int32)  # [BI_ROWS * (R + 1) + E]
            flat = self.inputs.numpy()
            flat[:] = 0
            self.views = input_views(flat, self.idx.numpy()[R:], R)
            self.inputs_np = self.views[0]  # [BI_ROWS, R + 1]
            self.inputs_addr = flat.ctypes.data
            self.exp_addr = self.idx.numpy()[R:].ctypes.data if E else 0
            self.qsl = self.inputs[T.BI_QSL * S : (T.BI_QSL + 1) * S]
            self.cu = self.inputs[T.BI_CU_LOGITS * S :]  # [S + E]: cu_num_logits, expanded_local_pos
            # per slot: cu_num_logits must outlive the step (ring_depth steps)
            self.dcu = mirror._device(S + E, torch.int32) if mirror.ops.asynchronous else self.cu
            self.cu_views = {}  # n -> the device cu_num_logits[:n + 1] (made once per size)
            self.exp_views = {}  # num_logits -> (expanded_idx_mapping, expanded_local_pos) on the device


class _Chunk(_Guarded):
    """One chunk of the overflow ring: a token area of its own, its event,
    its graphs by token bucket."""

    def __init__(self, mirror, capacity):
        self.tokens = _Area(mirror, capacity)
        self.event = mirror.ops.new_event()
        self.graphs = {}


class _Tensors:
    """The device tensors, with the host arrays' names and shapes."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    def __repr__(self):
        return f"DeviceTensors({', '.join(self.__dict__)})"


class _Layout:
    """The flat device tensor's layout and the staging, made once
    (``DeviceMirror.attach``); every allocation is counted for ``stats``."""

    def _pinned(self, n, dtype):
        t = self.ops.pinned_empty(n, dtype)
        self._pinned_bytes += t.numel() * t.element_size()
        return t

    def _device(self, n, dtype):
        t = self.ops.empty(n, dtype)
        self._device_bytes += t.numel() * t.element_size()
        return t

    def attach(self):
        """Lay out the flat device tensor, copy the current host state (once,
        at construction), make the staging slots and capture their graphs.
        Every view handed out starts on a 16-byte boundary (engines' kernels
        may assume it, e.g. vLLM's Triton block table loads): per-request
        rows have a stride of ``max_num_reqs`` rounded up to 4 elements, and
        each region starts aligned. An allocation that fails raises a
        StateError naming what was asked for (the table is not built); a
        capture that fails leaves the eager path (``path``, ``graph_error``)."""
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
        self._dummy = off = _aligned(off)  # where padding elements go: one element nobody reads
        off += 4
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
        ctx[T.TB_TOK_CAP] = self._tcap
        self._row_stride = SR
        self._layout = (nrows, SR, offsets, tok_off)
        try:
            self._flat = f = torch.zeros(off, dtype=torch.int32, device=self.device)  # [total elements]
            self._device_bytes += 4 * off
            host = np.zeros(off, np.int32)
            for o, a in self._host_regions():
                host[o : o + a.size] = a
            f.copy_(torch.from_numpy(host))
            self._make_staging()
        except (MemoryError, RuntimeError) as e:  # (torch's out-of-memory is a RuntimeError)
            raise StateError(
                f"device mirror: could not allocate its buffers on {self.device} ({e!r}): "
                f"{self._cap} staged elements and {self._tcap} token ids per slot, ring depth {self.ring_depth}; "
                "lower mirror_options 'staging_capacity', 'token_chunk' or 'ring_depth'"
            ) from e
        self._flat_np = f.numpy() if not self.ops.asynchronous else None
        tok_dst = self._tok_target if self._tok_target is not None else f
        self._tok_dst = tok_dst  # where the token areas scatter (positions include the flat offset)
        self._tok_np = tok_dst.numpy() if self._flat_np is not None else None
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
        self._capture_graphs()
        self.ops.synchronize()

    def _host_regions(self):
        """(flat offset, values) of every region that has a host copy: the
        state rows, the block tables, the token ids when on the device (the
        engine's own lengths and an engine's token tensor have none)."""
        t = self.table
        nrows, SR, offsets, tok_off = self._layout
        R = t.max_num_reqs
        state = np.zeros((nrows, SR), np.int32)
        state[:, :R] = t._state
        out = [(0, state.reshape(-1))]
        out += [(o, bt.reshape(-1)) for o, bt in zip(offsets, t.block_tables)]
        if tok_off >= 0:
            out.append((tok_off, t.token_ids.reshape(-1)))
        return out

    def _make_staging(self):
        """The slots, the overflow ring, the device buffers they share."""
        ops = self.ops
        R, L = self.table.max_num_reqs, self.table.max_model_len
        cap, tcap = self._cap, self._tcap
        bin_on = self._qsl_target is not None
        E = self.table._max_num_logits
        self._slots = [
            _Slot(self, cap, tcap, R, self._idx_on, bool(self._fills), bin_on, E) for _ in range(self.ring_depth)
        ]
        self._local_pos_zeros = None
        if bin_on:
            for slot in self._slots:  # the kernel writes a step's inputs into its slot's buffers
                self.table._b_inputs[slot.inputs_addr] = slot.views
            self._qsl_target_np = None if ops.asynchronous else self._qsl_target.numpy()
            self._local_pos_zeros = self._device(R, self._torch.int32)  # [R]: expanded_local_pos without drafts
            self._local_pos_zeros.zero_()
            self._zero_views = {}
        if tcap and tcap < R * L:  # a step can add more token ids than a slot holds
            self._chunks = [_Chunk(self, tcap) for _ in range(OVERFLOW_CHUNKS)]
            # their filler compiled (or loaded) now, not on the first step that needs it
            tok_fill(self.table._ix_addr, self.table._tok_runs.ctypes.data, 0, 0, 0, 0, 0)
        self._dstate = self._dtok = None
        if ops.asynchronous:
            self._dstate = _DeviceArea(self, cap)
            self._dtok = _DeviceArea(self, tcap) if tcap else None
        self._held += [*self._slots, *self._chunks, self._dstate, self._dtok]
        self._tok_runs_addr = self.table._tok_runs.ctypes.data
        if not ops.asynchronous:
            self.path = "host"
        elif not self._want_graphs or not ops.graphs:
            self.path = "eager"
            self.graph_error = None if not self._want_graphs else f"{type(ops).__name__} has no graphs"
        else:
            self.path = "graph"
