"""Device mirror: each step's changes reach torch tensors in one replay.

The host arrays stay the source of truth. The step kernels append every
element they change, as (flat position, value), to a pinned staging slot;
new requests' token ids go to the slot's token area (``_kernels/tokens.py``).
``end_step`` ships the slot: on CUDA by replaying, on the consumer's stream,
a CUDA graph captured once per slot, size bucket and kind of step, which
copies the slot (positions int64, values int32: 12 bytes per changed
element, padded to the bucket) and scatters it into a single flat int32
tensor of which every device tensor is a view; the same replay scatters the
token area into the token target, copies the step's batch ``idx_mapping``
and zeroes new rows of engine tensors, when asked to. Then one event, made
once per slot, is recorded: the slot is refilled only after it completed
(refilling a pinned buffer while a copy still reads it silently corrupts the
device data). The host waits only when the ring is full.

Everything is sized when the table is built: a slot holds what any one step
can stage apart from token ids (every row added and updated, with full block
tables), its token area ``token_chunk`` token ids; the token ids of a step
that adds more go in further chunks through a ring of their own, one replay
each. Nothing grows, and no graph is captured, while serving.

Where no graph can be captured the same work is issued eagerly (views made
once, on the consumer's stream); on the CPU the host runs it. A step's
device work is a list of operations issued in order; if one fails, those
not yet queued are kept and issued by the next call (after it has waited for
the device and rewritten every region the host holds), so no operation runs
twice. A device that fails to synchronize is unusable (a sticky error): every
later call says so.

Every device operation goes through a :class:`mtpstate.devices.DeviceOps`:
CUDA, the CPU, or, in tests, a deferred model of a GPU's asynchrony, on
which CI checks the ordering, the operation counts, the capture rules and
the fault handling.
"""

from __future__ import annotations

import weakref

import numpy as np

from mtpstate import devices
from mtpstate._kernels import slots as T
from mtpstate._kernels.tokens import tok_fill
from mtpstate.errors import CapacityError, MirrorFaultError, StateError
from mtpstate.results import input_views

__all__ = ["DeviceMirror", "MIRRORED_FIELDS", "step_capacity"]

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


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised without torch only
        raise StateError("the device mirror needs torch: pip install 'mtpstate[torch]'") from e
    return torch


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


class DeviceMirror:
    """Keeps torch tensors on ``device`` equal to a RequestTable's host arrays.

    Created by ``RequestTable(..., device=...)``; not used directly.

    Parameters
    ----------
    table : RequestTable
    device : str or torch.device
    ring_depth : int
        Staging slots (>= 2): the number of steps whose device work may be
        in flight at once.
    token_ids_on_device : bool
        True: ``token_ids`` is a device tensor, updated like the rest.
        False (CPU only): it stays in host memory, and
        ``device_tensors.token_ids`` is that host tensor. Refused on an
        asynchronous device: the host would write new requests' tokens into
        memory that device work still in flight may read; use
        ``token_ids_target`` there (its writes go through the staged copy).
    staging_capacity : int, optional
        Elements other than token ids one step may stage (default:
        :func:`step_capacity`, what any step a table of this shape accepts
        can stage). A step that stages more is refused with a
        :class:`~mtpstate.CapacityError`, and changes nothing.
    token_chunk : int, optional
        Token ids a slot's token area holds, and each chunk of the overflow
        ring (default: ``min(max_num_reqs * max_model_len, max(max_model_len,
        262144))``). A step that adds more token ids ships the rest in
        further chunks, one replay each, waiting only for a chunk of its own
        ring still in flight.
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
        An engine's ``[max_num_reqs, max_model_len]`` int32 tensor on the
        mirror's device (a device tensor, or pinned host memory mapped into
        the device's address space, as vLLM's UVA ``all_token_ids``): new
        requests' prefill token ids are scattered into it by the step's
        device work, in stream order, instead of into a mirrored
        ``token_ids`` (implies ``token_ids_on_device=False``). The table then
        keeps no host copy of the token ids (``RequestTable.token_ids`` is
        None): the target, which can be several GB, is the only one.
    idx_mapping : bool
        Ship each step's batch ``idx_mapping`` (int64) in the same device
        work: :meth:`RequestTable.device_idx_mapping`. Needs the table's
        ``decode_query_len``.
    query_start_loc_target : torch.Tensor, optional
        An int32 tensor of ``max_num_reqs + 1`` on the mirror's device (vLLM's
        ``InputBuffers.query_start_loc``): each step's batch
        ``query_start_loc`` (padded with ``num_tokens``) is copied into it by
        the step's device work, and its ``cu_num_logits`` into a device
        buffer of the slot (:meth:`RequestTable.device_batch_inputs`).
        Needs ``idx_mapping``.
    zero_rows_on_add : sequence of torch.Tensor, optional
        Engine tensors (first dimension ``max_num_reqs``, on the mirror's
        device) whose rows a step adds are zeroed by that step's device work
        (vLLM's speculative ``draft_tokens``).
    graphs : bool
        Capture the step's device work as graphs where the device can
        (default); False: issue it eagerly.
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
        token_chunk=None,
        fields=None,
        engine_lengths: bool = False,
        token_ids_target=None,
        idx_mapping: bool = False,
        query_start_loc_target=None,
        zero_rows_on_add=(),
        graphs: bool = True,
        ops=None,
    ):
        torch = _torch()
        self._torch = torch
        if ring_depth < 2:
            raise ValueError("ring_depth must be >= 2")
        requested = torch.device(device)
        if requested.type == "cuda" and not torch.cuda.is_available():
            raise StateError(f"device {device!r} requested but CUDA is not available")
        self.ops = ops = devices.ops_for(torch, requested) if ops is None else ops
        self.asynchronous = ops.asynchronous
        self.device = ops.device if ops.device.type == requested.type else requested  # index resolved
        self.is_cuda = self.device.type == "cuda"
        if ops.capturing():  # before any allocation, copy or synchronization
            raise StateError(_capturing("building a device table"))
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
            if not tt.is_contiguous():
                raise ValueError("token_ids_target must be contiguous")
            self._check_on_device("token_ids_target", tt)
            self._tok_target = tt.view(-1)
            token_ids_on_device = False
        elif not token_ids_on_device and ops.asynchronous:
            raise ValueError(
                "token_ids_on_device=False is refused on an asynchronous device: the host would write new "
                "requests' token ids into memory that device work in flight may still read; pass "
                "token_ids_target= (an engine tensor, written through the staged copy) or keep the default"
            )
        if idx_mapping and not table.decode_query_len:
            raise ValueError("idx_mapping=True needs the table's decode_query_len (the step's batch)")
        self._idx_on = bool(idx_mapping)
        self._qsl_target = None
        if query_start_loc_target is not None:
            q = query_start_loc_target
            if not self._idx_on:
                raise ValueError("query_start_loc_target needs idx_mapping=True (the step's batch)")
            if not isinstance(q, torch.Tensor) or q.dtype != torch.int32 or tuple(q.shape) != (R + 1,):
                raise ValueError(f"query_start_loc_target must be an int32 tensor of shape ({R + 1},)")
            if not q.is_contiguous():
                raise ValueError("query_start_loc_target must be contiguous")
            self._check_on_device("query_start_loc_target", q)
            self._qsl_target = q
        self._fills = list(zero_rows_on_add or ())
        for z in self._fills:
            if not isinstance(z, torch.Tensor) or z.dim() < 1 or z.shape[0] != R:
                raise ValueError(f"zero_rows_on_add takes tensors of {R} rows on {self.device}")
            self._check_on_device("zero_rows_on_add", z)
        self.token_ids_on_device = token_ids_on_device
        self._host_tok_tensor = None
        if not token_ids_on_device and token_ids_target is None:
            self._host_tok_tensor = torch.zeros((R, L), dtype=torch.int32)
        bound = step_capacity(R, table.num_groups, table.max_num_blocks_per_group)
        self._cap = _positive("staging_capacity", staging_capacity, bound)
        stages_tokens = token_ids_on_device or token_ids_target is not None
        self._tcap = _positive("token_chunk", token_chunk, min(R * L, max(L, TOKEN_CHUNK))) if stages_tokens else 0
        self._want_graphs = bool(graphs)
        self.path = None  # "graph", "eager" or "host": how each step's device work is issued
        self.graph_error = None  # why graphs are not in use, where they were wanted
        self._pinned_bytes = self._device_bytes = self._pool_bytes = 0
        self._slots = []
        self._chunks = []  # the overflow ring (only where a step can add more than a slot's token area)
        self._next = self._next_chunk = 0
        self._open = None
        self._stream = self._stream_key = None  # the consumer's stream, as of the last step
        self._nn = 0  # the shipping step's new rows
        self._fault = None  # what a failed step left to do (_Fault)
        self._lost = None  # the message of a device that failed to synchronize: unusable
        self._closed = False
        self._blocked = False  # closed, or the device lost: every call refused
        self._idx_slot, self._idx_n = None, 0
        self._last = None  # (n, tokens, idx shipped, rows shipped, chunks) of the last step that shipped
        self._rows_rings = {}
        # buffers the device may read: kept (and waited for) until close() or the finalizer
        self._held = []
        self._finalizer = weakref.finalize(self, _release, ops, self._held)

    # the table asks for these before it allocates its own token_ids
    @property
    def host_token_ids(self):
        return None if self._host_tok_tensor is None else self._host_tok_tensor.numpy()

    @property
    def keeps_host_token_ids(self) -> bool:
        """False when an engine's tensor is the only copy of the token ids."""
        return self._tok_target is None

    def _check_on_device(self, what, tensor) -> None:
        d = tensor.device
        same = d.type == self.device.type and (
            d.type != "cuda"
            or (d.index if d.index is not None else self._torch.cuda.current_device()) == self.device.index
        )
        if not same:
            raise ValueError(f"{what} is on {d}, the table's mirror on {self.device}: it must be on the same device")

    # -- allocation (counted: transfer_stats reports it) ----------------------

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

    # -- staging and its graphs, made once ------------------------------------

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

    def _kinds(self) -> list[int]:
        return [V_PLAIN] + ([V_NEW] if self._fills else []) + ([V_TOK] if self._tcap else [])

    def _capture_graphs(self):
        """Every graph, once: per slot, each kind of step at each bucket (and
        token bucket), and per overflow chunk each token bucket. A capture
        that fails leaves the eager path, said in ``path`` and ``graph_error``."""
        if self.path != "graph":
            return
        ops, torch = self.ops, self._torch
        try:
            n = max(self._cap, self._tcap)
            self._iota = self._device(n, torch.int64)  # [max(cap, token_chunk)]: sliced per bucket, shared
            self._iota.copy_(torch.arange(n, dtype=torch.int64))
            self._spare = torch.full((1,), self._dummy, dtype=torch.int64, device=self._iota.device)
            self._device_bytes += 8
            self._warm_up()
            reserved = ops.memory_reserved()
            pool = None
            for s in self._slots:
                for key in self._graph_keys():
                    pool = self._capture(s, key, self._step_work(s, *key), pool)
            for c in self._chunks:
                for ti in range(len(c.tokens.sizes)):
                    pool = self._capture(c, ti, self._chunk_work(c, ti), pool)
            ops.synchronize()
            self._pool_bytes = max(0, ops.memory_reserved() - reserved)
        except Exception as e:  # any capture failure (out of memory included): the same work, issued eagerly
            for s in (*self._slots, *self._chunks):
                s.graphs.clear()
            self.path, self.graph_error = "eager", f"capture failed: {e!r}"

    def _graph_keys(self):
        nb = len(self._slots[0].state.sizes)
        nt = len(self._slots[0].tokens.sizes) if self._tcap else 0
        for kind in self._kinds():
            for bi in range(nb):
                if kind == V_TOK:
                    for ti in range(nt):
                        yield (kind, bi, ti)
                else:
                    yield (kind, bi, None)

    def _capture(self, owner, key, work, pool):
        g = self.ops.capture(work, pool)
        if pool is None and hasattr(g, "pool"):
            pool = g.pool()  # one memory pool for all: the replays never overlap
        # the graph reads the tensors the work was captured with (its views
        # of the shared buffers): they live as long
        owner.graphs[key] = (g, work)
        return pool

    def _warm_up(self):
        """Each kind's work run once eagerly (so that lazy module loads happen
        outside any capture) on the first slot's zeroed buffers: the headers
        say nothing is staged, so the flat tensor gets only the spare
        element, and the token scatter and the row fills go to scratch
        tensors in place of the engine's: nothing an engine holds is written."""
        torch = self._torch
        s0 = self._slots[0]
        tok = torch.zeros(1, dtype=torch.int32, device=self._flat.device)
        fills = [torch.zeros((1, *z.shape[1:]), dtype=z.dtype, device=z.device) for z in self._fills]
        for kind in self._kinds():
            self._step_work(s0, kind, 0, 0 if kind == V_TOK else None, tok, fills)()
        self.ops.synchronize()

    def _scatter_work(self, area, bi, dev, target, spare):
        """An area's first bucket-``bi`` elements and header copied to the
        device, then its live elements (the header's count) scattered into
        ``target``; the rest go to the ``spare`` position, or, without one,
        rewrite the first element with its own value."""
        torch = self._torch
        hpos, hval = area.views[bi]
        dpos, p, dval = dev.views[bi]
        iota = self._iota[: area.sizes[bi]]

        def work():
            dpos.copy_(hpos, non_blocking=True)
            dval.copy_(hval, non_blocking=True)
            live = iota < dpos[0]
            if spare is None:
                target.index_copy_(0, torch.where(live, p, p[0]), torch.where(live, dval, dval[0]))
            else:
                target.index_copy_(0, torch.where(live, p, spare), dval)

        return work

    def _step_work(self, slot, kind, bi, ti=None, tok=None, fills=None):
        """The device work of one step of ``kind`` whose staged elements fit
        bucket ``bi`` (and token ids token bucket ``ti``): the slot's
        scatters, and by kind the batch's idx_mapping, the new rows zeroed
        (``tok``, ``fills``: other targets than the engine's, for the warm-up)."""
        parts = [self._scatter_work(slot.state, bi, self._dstate, self._flat, self._spare)]
        if kind == V_TOK:
            parts.append(self._scatter_work(slot.tokens, ti, self._dtok, self._tok_dst if tok is None else tok, None))
        fills = () if kind == V_PLAIN else self._fills if fills is None else fills
        qsl = self._qsl_target if slot.inputs is not None else None

        def work():
            for part in parts:
                part()
            if slot.idx is not None:
                slot.didx.copy_(slot.idx, non_blocking=True)
            if qsl is not None:
                qsl.copy_(slot.qsl, non_blocking=True)
                slot.dcu.copy_(slot.cu, non_blocking=True)
            if fills:
                slot.drows.copy_(slot.rows, non_blocking=True)
                for z in fills:
                    z.index_fill_(0, slot.drows, 0)

        return work

    def _chunk_work(self, chunk, ti):
        return self._scatter_work(chunk.tokens, ti, self._dtok, self._tok_dst, None)

    # -- per step ------------------------------------------------------------

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

    def begin_step(self, what: str = "apply"):
        """Point the kernels at a free staging slot (waiting only if the ring
        is full); what a failed step left is issued first."""
        if self._blocked or (self.asynchronous and self.ops.capturing()):
            self._usable(what)
        if self._fault is not None:
            self.resync()
        if self._open is None:
            slot = self._slots[self._next]
            if slot.pending:
                self._wait(slot)  # its replay may still be reading it
            self._open = slot
            cv = self.table._cv  # (the context as Python ints: cheaper than numpy scalars)
            cv[T.TB_STG_POS], cv[T.TB_STG_VAL], cv[T.TB_STG_CAP] = slot.state.addrs
            cv[T.TB_STG_ON] = 1
            if slot.inputs is not None:
                cv[T.TB_BIN] = slot.inputs_addr
                cv[T.TB_BEXP] = slot.exp_addr
        self.table._cv[T.TB_STG_N] = 0

    def abort_step(self):
        """Close a step that will ship nothing (rejected, or already ended)."""
        if self._open is not None:
            self._open = None
            self.table._cv[T.TB_STG_ON] = 0

    def capacity_error(self, need: int) -> CapacityError:
        return CapacityError(
            f"the step stages {need} elements on the device, more than the mirror's {self._cap} per step "
            "(mirror_options 'staging_capacity'; its default holds every step a table of this shape accepts, "
            "except a request re-sent as resumed in the step that added it); nothing was applied"
        )

    def check_staged(self, need: int, what: str) -> None:
        """Before a call that changes the host outside the step kernel (the
        array entry point): usable, and ``need`` elements fit a slot."""
        self._usable(what)
        if need > self._cap:
            raise self.capacity_error(need)

    def end_step(self, n: int, n_tok: int = 0, deduplicate: bool = False, results: bool = True):
        """Ship the first ``n`` staged elements of the open slot and the
        step's ``n_tok`` token ids (its token area's, then the overflow
        chunks'), and, with ``results``, what the step's results add (the
        batch's idx_mapping, the new rows to zero); returns without waiting.
        A failure of the device work raises :class:`~mtpstate.MirrorFaultError`;
        what was not queued is issued by the next call."""
        t = self.table
        cv = t._cv
        nb = cv[T.TB_B_N] if results and self._idx_on else -1
        nn = cv[T.TB_RES_NN] if results and self._fills else 0
        if n == 0 and n_tok == 0 and nb < 0 and nn == 0:  # nothing to ship: the slot stays open for the next step
            cv[T.TB_STG_N] = 0
            self._last = None
            return
        slot = self._open
        self._open = None
        self._next = (self._next + 1) % len(self._slots)  # (on the host too: idx_mapping lives ring_depth steps)
        cv[T.TB_STG_ON] = 0  # nothing is staged between steps
        if deduplicate:  # the same element written twice in one step: keep the last write
            p = slot.state.pos_np[:n][::-1]
            _, first = np.unique(p, return_index=True)
            keep = np.sort(n - 1 - first)
            m = len(keep)
            pos, val = slot.state.pos_np[keep], slot.state.val_np[keep]
            slot.state.pos_np[:m] = pos
            slot.state.val_np[:m] = val
            n = m
        if self.path == "graph":  # the counts the graph reads on the device
            slot.state.meta_np[0] = n
            if n_tok:
                slot.tokens.meta_np[0] = n_tok if n_tok <= self._tcap else self._tcap
        if nb >= 0:
            slot.idx_np[:nb] = t._b_idx[:nb]
            self._idx_slot, self._idx_n = slot, nb
        elif slot.inputs is not None and self._idx_slot is not None:
            # no batch (the array entry point): the target gets what it last got
            slot.inputs_np[T.BI_QSL] = self._idx_slot.inputs_np[T.BI_QSL]
        if nn:
            nc = cv[T.TB_RES_NC]
            new = t._res[nc : nc + nn]
            slot.rows_np[:nn] = new
            slot.rows_np[nn:] = new[0]  # padding: the same row zeroed again
        self._nn = nn
        self._last = (n, n_tok, nb >= 0, nn > 0, 0)
        self._ship(slot, n, n_tok)

    def _ship(self, slot, n, n_tok):
        """The step's device work: its slot's (one replay, or the same work
        issued eagerly, or run by the host), the slot's event, then any
        overflow chunks."""
        tcap = self._tcap
        m = n_tok if n_tok <= tcap else tcap  # token ids in the slot's token area
        self._shipped = m  # token ids of the step queued so far (or in the slot's work)
        self._done = 0
        slot_done = False
        try:
            if self.asynchronous:
                ops = self.ops
                if ops.stream_key() != self._stream_key:
                    self._follow_stream()
                self._slot_work(slot, n, m, self._nn, 0)
                slot_done = True
                slot.pending = True  # (before the record: a failed record leaves it to the drain)
                ops.record(slot.event, self._stream)
            else:  # the CPU (_slot_work's host branch, inline: the host path's every step)
                st = slot.state
                self._flat_np[st.pos_np[:n]] = st.val_np[:n]
                if slot.inputs is not None:
                    self._qsl_target_np[:] = slot.inputs_np[T.BI_QSL]
                self._done = 1
                if m or self._nn:
                    self._host_rest(slot, m, self._nn, 1)
                slot_done = True
            if n_tok > m:
                self._ship_overflow(n_tok, self.table._cv[T.TB_RES_NN])
        except BaseException as e:
            self._failed(e, _Fault(slot, n, m, self._nn, self._done, slot_done, None), n_tok)

    def _slot_work(self, slot, n, m, nn, start):
        """Issue the slot's device work for ``n`` staged elements, ``m`` token
        ids and ``nn`` new rows, one operation at a time in order, from its
        operation ``start`` on (those before were queued by the call that
        failed); ``_done`` counts the operations queued."""
        if self.path == "graph":  # one operation: the replay
            if start == 0:
                kind = V_TOK if m else V_NEW if nn else V_PLAIN
                key = (kind, slot.state.bucket(n), slot.tokens.bucket(m) if m else None)
                self.ops.replay(slot.graphs[key][0])
            self._done = 1
            return
        if self.path == "host":  # the CPU: the host's writes (the same memory), in order
            if start == 0:
                st = slot.state
                self._flat_np[st.pos_np[:n]] = st.val_np[:n]
                if slot.inputs is not None:
                    self._qsl_target_np[:] = slot.inputs_np[T.BI_QSL]
                self._done = 1
            if m or nn:
                self._host_rest(slot, m, nn, start)
            return
        for k, op in enumerate(self._eager_ops(slot, n, m, nn)):
            if k >= start:
                op()
                self._done = k + 1

    def _host_rest(self, slot, m, nn, start):
        """The host's writes after the staged elements: the token ids, then
        the new rows zeroed in each engine tensor (operations 1, 2, ...)."""
        k = 1
        if m:
            if start <= k:
                _host_scatter(self._tok_np, slot.tokens, m)
                self._done = k + 1
            k += 1
        for z in self._fills if nn else ():
            if start <= k:
                self.ops.fill_rows(z, slot.rows[:nn], 0)
                self._done = k + 1
            k += 1

    def _eager_ops(self, slot, n, m, nn):
        """The slot's work as separate operations (no graph to replay)."""
        ops = self.ops
        yield from self._eager_scatter(slot.state, n, self._dstate, self._flat, self._dummy)
        if m:
            yield from self._eager_scatter(slot.tokens, m, self._dtok, self._tok_dst, None)
        if slot.idx is not None:
            yield lambda: ops.copy(slot.didx, slot.idx)
        if slot.inputs is not None:
            yield lambda: ops.copy(self._qsl_target, slot.qsl)
            yield lambda: ops.copy(slot.dcu, slot.cu)
        if nn:
            yield lambda: ops.copy(slot.drows, slot.rows)
            for z in self._fills:
                yield lambda z=z: ops.fill_rows(z, slot.drows, 0)

    def _eager_scatter(self, area, n, dev, target, spare):
        """An area's work as separate operations: padding written by the
        host (to the spare element, or repeating the first element), the
        bucket's copies, the scatter."""
        ops = self.ops
        bi = area.bucket(n)
        b = area.sizes[bi]
        if spare is None:
            area.pos_np[n:b] = area.pos_np[0]
            area.val_np[n:b] = area.val_np[0]
        else:
            area.pos_np[n:b] = spare
        hpos, hval = area.views[bi]
        dpos, p, dval = dev.views[bi]
        return [lambda: ops.copy(dpos, hpos), lambda: ops.copy(dval, hval), lambda: ops.scatter(target, p, dval)]

    def _issue(self, items):
        """Issue each item in order, removing it once queued (what is left
        after a failure is what never ran)."""
        while items:
            items[0]()
            del items[0]

    def _record(self, guarded):
        if self.asynchronous:
            guarded.pending = True  # (before the record: a failed record leaves it to the drain)
            self.ops.record(guarded.event, self._stream)

    def _wait(self, guarded):
        """Wait for a slot's or chunk's last work; a device that cannot answer is unusable."""
        try:
            guarded.wait_idle(self.ops)
        except Exception as e:
            self._unusable(e)

    def _ship_overflow(self, n_tok, nruns):
        """The step's token ids past its slot's token area, a chunk at a
        time through the overflow ring: fill (from the step's runs), one
        replay (or its work eagerly, or the host's), one event."""
        ixc = self.table._ix_addr
        while self._shipped < n_tok:
            c = self._chunks[self._next_chunk]
            self._next_chunk = (self._next_chunk + 1) % len(self._chunks)
            if c.pending:
                self._wait(c)
            a = c.tokens
            m = tok_fill(ixc, self._tok_runs_addr, nruns, self._shipped, a.capacity, a.addrs[0], a.addrs[1])
            self._issue(self._chunk_items(c, m))
            self._shipped += m
            self._record(c)
            n, tok, idx, rows, chunks = self._last
            self._last = (n, tok, idx, rows, chunks + 1)

    def _chunk_items(self, chunk, m):
        a = chunk.tokens
        if self.path == "graph":
            a.meta_np[0] = m
            g = chunk.graphs[a.bucket(m)][0]
            return [lambda: self.ops.replay(g)]
        if self.path == "host":
            return [lambda: _host_scatter(self._tok_np, a, m)]
        return self._eager_scatter(a, m, self._dtok, self._tok_dst, None)

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

    def _follow_stream(self):
        """The consumer moved to another stream (or this is the first step):
        its work from now on runs after everything queued on the previous
        one, so steps still apply in order."""
        ops = self.ops
        cur = ops.current_stream()
        if self._stream is not None:
            ops.wait_stream(cur, self._stream)
        self._stream, self._stream_key = cur, ops.stream_key()

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

    def synchronize(self):
        self._usable("synchronize")
        self.resync()
        self._drain()

    def _drain(self):
        """Wait until every queued operation has run: no slot or row buffer
        is read by the device any more. A device that cannot is unusable."""
        try:
            self.ops.synchronize()
        except Exception as e:
            self._unusable(e)
        for g in self._held:
            if isinstance(g, _Guarded):
                g.pending = False
            elif isinstance(g, _RowsRing):
                g.pending = [False] * g.depth

    def _unusable(self, e):
        self._blocked = True
        self._lost = (
            f"device mirror: the device {self.device} is unusable ({e!r} while waiting for it: a sticky device "
            "error, which every later device call reports until the process recreates its device context); "
            "the host arrays hold every applied step; the device tensors are not current; build a new table "
            "on a working device"
        )
        raise MirrorFaultError(self._lost) from e

    def close(self):
        """Wait for the device work still in flight that reads the mirror's
        buffers, then release them (the finalizer does the same when the
        table is dropped). Later calls that need the device raise StateError."""
        if self._closed:
            return
        self._closed = self._blocked = True
        self._open = None
        self._finalizer()
        self._slots, self._chunks, self._rows_rings = [], [], {}
        self._dstate = self._dtok = self._iota = None
        self._idx_slot = None

    def stats(self) -> dict:
        """The last step's host-to-device traffic, and the memory the mirror
        holds (see ``RequestTable.transfer_stats``)."""
        out = {"bytes": 0, "copies": 0, "path": self.path, "replays": 0}
        if self._last is not None and self._slots:
            n, n_tok, idx, rows, chunks = self._last
            if self.path == "host":  # nothing copied: the host writes what changed
                out["bytes"] = 12 * (n + n_tok)
            else:
                st, tk = self._slots[0].state, self._slots[0].tokens
                m = min(n_tok, self._tcap)
                rest = n_tok - m
                R = self.table.max_num_reqs
                nbytes = 8 * META + 12 * st.sizes[st.bucket(n)] + 8 * R * (idx + rows)
                binp = self._qsl_target is not None
                # query_start_loc and cu_num_logits, expanded_idx_mapping and expanded_local_pos
                nbytes += (8 * (R + 1) + 12 * self.table._max_num_logits) * binp
                if m:
                    nbytes += 8 * META + 12 * tk.sizes[tk.bucket(m)]
                if rest:  # full chunks, then the last one's bucket
                    last = rest - (chunks - 1) * self._tcap
                    nbytes += (chunks - 1) * (8 * META + 12 * self._tcap) + 8 * META + 12 * tk.sizes[tk.bucket(last)]
                out["bytes"] = nbytes
                out["copies"] = 2 + 2 * (m > 0) + idx + 2 * binp + rows + 2 * chunks
                out["replays"] = (1 + chunks) if self.path == "graph" else 0
        out.update(
            {
                "staging_capacity": self._cap,
                "token_chunk": self._tcap,
                "overflow_chunks": len(self._chunks),
                "pinned_bytes": self._pinned_bytes,
                "device_bytes": self._device_bytes + self._pool_bytes,
                "graph_pool_bytes": self._pool_bytes,
                "graph_error": self.graph_error,
            }
        )
        return out


def _host_scatter(dst_np, area, n):
    """The CPU: the host writes the device tensors (the same memory)."""
    dst_np[area.pos_np[:n]] = area.val_np[:n]


def _release(ops, held):
    """The finalizer: wait for the device work that reads the buffers, then
    let both allocators have them back."""
    for g in held:
        try:
            if g is not None and hasattr(g, "wait_idle"):
                g.wait_idle(ops)
        except Exception:  # an unusable device, or interpreter exit: nothing left to wait for
            pass
    held.clear()


def _capturing(what: str) -> str:
    return (
        f"{what} while the current stream is capturing a CUDA graph: refused before any allocation, copy or "
        "event record, so the capture stays valid; call it before or after the engine's capture"
    )


def _positive(name, value, default) -> int:
    if value is None:
        return default
    import operator

    v = operator.index(value)
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return v


def _aligned(n: int) -> int:
    """``n`` int32 elements rounded up to a 16-byte boundary."""
    return (n + 3) // 4 * 4


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


class _Tensors:
    """The device tensors, with the host arrays' names and shapes."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    def __repr__(self):
        return f"DeviceTensors({', '.join(self.__dict__)})"
