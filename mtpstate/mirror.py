"""Device mirror: each step's changes reach torch tensors in one replay.

The host arrays stay the source of truth. The step kernels append every
element they change, as (flat position, value), to a pinned staging slot.
``end_step`` ships the slot: on CUDA by replaying, on the consumer's stream,
a CUDA graph captured once per slot, size bucket and kind of step, which
copies the slot (positions int64, values int32: 12 bytes per changed
element, padded to the bucket) and scatters it into a single flat int32
tensor of which every device tensor is a view; the same replay scatters new
requests' token ids into an engine's token tensor, copies the step's batch
``idx_mapping`` and zeroes new rows of engine tensors, when asked to. Then
one event, made once per slot, is recorded: the slot is refilled only after
it completed (refilling a pinned buffer while a copy still reads it silently
corrupts the device data). The host waits only when the ring is full.

Where no graph can be captured the same work is issued eagerly (views made
once, on the consumer's stream); on the CPU the host runs it. A step whose
device work fails after the host arrays were changed leaves the mirror
stale, and the next call resynchronizes it in full before anything else.

Every device operation goes through a :class:`mtpstate.devices.DeviceOps`:
CUDA, the CPU, or, in tests, a deferred model of a GPU's asynchrony, on
which CI checks the ordering, the operation counts and the fault handling.
"""

from __future__ import annotations

import numpy as np

from mtpstate import devices
from mtpstate._kernels import slots as T
from mtpstate.errors import MirrorFaultError, StateError

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

META = 2  # int64 header of a slot's positions buffer: [staged elements, of which token ids]
BUCKET0 = 256  # smallest size bucket; each next one is 4x larger, the last the capacity

# kinds of step, one graph each per slot and bucket
V_PLAIN = 0  # the staged elements (+ idx_mapping)
V_NEW = 1  # + the new rows zeroed in the engine's tensors
V_TOK = 2  # + new requests' token ids scattered into the token target


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


class _Slot:
    """One staging slot: pinned host buffers, the device buffers its replay
    copies them into, the event that says that replay has completed, and the
    slot's graphs by (kind of step, bucket)."""

    def __init__(self, ops, capacity, R, idx, rows):
        torch = ops.torch
        self.pos = ops.pinned_empty(META + capacity, torch.int64)  # [META + cap]
        self.val = ops.pinned_empty(capacity, torch.int32)  # [cap]
        pos = self.pos.numpy()
        pos[:] = 0
        self.val.numpy()[:] = 0
        self.meta_np = pos[:META]
        # numpy views of the same memory: the kernels write through these
        self.pos_np = pos[META:]
        self.val_np = self.val.numpy()
        self.addrs = (self.pos.data_ptr() + 8 * META, self.val.data_ptr(), capacity)
        self.capacity = capacity
        self.idx = ops.pinned_empty(R, torch.int64) if idx else None  # [R]: the batch's idx_mapping
        self.rows = ops.pinned_empty(R, torch.int64) if rows else None  # [R]: new rows, padded
        for b in (self.idx, self.rows):
            if b is not None:
                b.numpy()[:] = 0
        self.idx_np = None if self.idx is None else self.idx.numpy()
        self.rows_np = None if self.rows is None else self.rows.numpy()
        self.event = ops.new_event()
        self.pending = False  # the event was recorded after work that reads this slot
        self.graphs = {}  # (kind, bucket) -> (graph, the captured work, which holds its tensors)
        if ops.asynchronous:
            self.dpos = ops.empty(META + capacity, torch.int64)
            self.dval = ops.empty(capacity, torch.int32)
            self.didx = ops.empty(R, torch.int64) if idx else None
            self.drows = ops.empty(R, torch.int64) if rows else None
        else:  # the host runs the work: the staged buffers are the device side
            self.dpos, self.dval, self.didx, self.drows = self.pos, self.val, self.idx, self.rows
        # views made once per bucket: (host positions, host values, device positions, device values)
        self.views = [
            (self.pos[: META + b], self.val[:b], self.dpos[: META + b], self.dval[:b]) for b in bucket_sizes(capacity)
        ]
        self.idx_views = {}  # n -> the device idx_mapping[:n] (made once per size)


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
        Initial elements per slot; grown on demand (graphs recaptured).
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
        requests' prefill token ids are scattered into it by the step's
        device work, in stream order, instead of into a mirrored
        ``token_ids`` (implies ``token_ids_on_device=False``). The table then
        keeps no host copy of the token ids (``RequestTable.token_ids`` is
        None): the target, which can be several GB, is the only one.
    idx_mapping : bool
        Ship each step's batch ``idx_mapping`` (int64) in the same device
        work: :meth:`RequestTable.device_idx_mapping`. Needs the table's
        ``decode_query_len``.
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
        fields=None,
        engine_lengths: bool = False,
        token_ids_target=None,
        idx_mapping: bool = False,
        zero_rows_on_add=(),
        graphs: bool = True,
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
        if idx_mapping and not table.decode_query_len:
            raise ValueError("idx_mapping=True needs the table's decode_query_len (the step's batch)")
        self._idx_on = bool(idx_mapping)
        self._fills = list(zero_rows_on_add or ())
        for z in self._fills:
            if not isinstance(z, torch.Tensor) or z.dim() < 1 or z.shape[0] != R or z.device.type != self.device.type:
                raise ValueError(f"zero_rows_on_add takes tensors of {R} rows on {self.device}")
        self.token_ids_on_device = token_ids_on_device
        self._host_tok_tensor = None
        if not token_ids_on_device and token_ids_target is None:
            self._host_tok_tensor = torch.zeros((R, L), dtype=torch.int32)
        self._cap = staging_capacity or max(1024, 4 * R)
        self._want_graphs = bool(graphs)
        self._warmed = False  # the graphs' operations ran once eagerly (see _warm_up)
        self.path = None  # "graph", "eager" or "host": how each step's device work is issued
        self.graph_error = None  # why graphs are not in use, where they were wanted
        self._slots = []
        self._next = 0
        self._open = None
        self._stream = self._stream_key = None  # the consumer's stream, as of the last step
        self._nn = 0  # the shipping step's new rows
        self._stale = None  # (slot, n, n_tok, nn) of a step whose device work failed
        self._idx_slot, self._idx_n = None, 0
        self._last = None  # (n, idx shipped, rows shipped) of the last step that shipped
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
        """Lay out the flat device tensor, copy the current host state (once,
        at construction), make the staging slots and capture their graphs.
        Every view handed out starts on a 16-byte boundary (engines' kernels
        may assume it, e.g. vLLM's Triton block table loads): per-request
        rows have a stride of ``max_num_reqs`` rounded up to 4 elements, and
        each region starts aligned."""
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
        self._row_stride = SR
        self._layout = (nrows, SR, offsets, tok_off)
        self._flat = f = torch.zeros(off, dtype=torch.int32, device=self.device)  # [total elements]
        host = np.zeros(off, np.int32)
        for o, a in self._host_regions():
            host[o : o + a.size] = a
        f.copy_(torch.from_numpy(host))
        self._flat_np = f.numpy() if not self.ops.asynchronous else None
        self._tok_np = self._tok_target.numpy() if self._tok_target is not None and self._flat_np is not None else None
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
        self._make_slots(self._cap)
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

    # -- slots and their graphs ------------------------------------------------

    def _make_slots(self, cap):
        ops = self.ops
        R = self.table.max_num_reqs
        self._cap = cap
        self._sizes = bucket_sizes(cap)
        self._slots = [_Slot(ops, cap, R, self._idx_on, bool(self._fills)) for _ in range(self.ring_depth)]
        self._next = 0
        self._idx_slot = None
        if not ops.asynchronous:
            self.path = "host"
        elif not self._want_graphs or not ops.graphs:
            self.path = "eager"
            self.graph_error = None if not self._want_graphs else f"{type(ops).__name__} has no graphs"
        elif ops.capturing():
            self.path, self.graph_error = "eager", "constructed inside a graph capture"
        else:
            try:
                self._capture_all()
                self.path, self.graph_error = "graph", None
            except Exception as e:  # any capture failure: the same work, issued eagerly
                for s in self._slots:
                    s.graphs.clear()
                self.path, self.graph_error = "eager", f"capture failed: {e!r}"

    def _bucket(self, n: int) -> int:
        return bucket_of(n, len(self._sizes) - 1)

    def _kinds(self) -> list[int]:
        return [V_PLAIN] + ([V_NEW] if self._fills else []) + ([V_TOK] if self._tok_target is not None else [])

    def _capture_all(self):
        ops = self.ops
        kinds = self._kinds()
        if not self._warmed:
            self._warm_up()
            self._warmed = True
        pool = None
        for s in self._slots:
            for bi in range(len(self._sizes)):
                for v in kinds:
                    work = self._graph_work(s, bi, v)
                    g = ops.capture(work, pool)
                    if pool is None and hasattr(g, "pool"):
                        pool = g.pool()  # one memory pool for all: the replays never overlap
                    # the graph reads the tensors the work was captured with
                    # (its iota, the spare element's index): they live as long
                    s.graphs[v, bi] = (g, work)
        ops.synchronize()

    def _warm_up(self):
        """Each kind's work run once eagerly (so that lazy module loads happen
        outside any capture) on the first slot's zeroed buffers: the header
        says nothing is staged, so the flat tensor gets only the spare
        element, and the token scatter and the row fills go to scratch
        tensors in place of the engine's: nothing an engine holds is written."""
        torch = self._torch
        s0 = self._slots[0]
        tok = torch.zeros(1, dtype=torch.int32, device=s0.dpos.device)
        fills = [torch.zeros((1, *z.shape[1:]), dtype=z.dtype, device=z.device) for z in self._fills]
        for kind in self._kinds():
            self._graph_work(s0, 0, kind, tok, fills)()
        self.ops.synchronize()

    def _graph_work(self, slot, bi, kind, tok=None, fills=None):
        """The device work of one step of ``kind`` whose staged elements fit
        bucket ``bi``, reading its counts from the slot's header on the
        device: copies of the slot, the scatter of the live elements into
        the flat tensor (the rest to the spare element), and by kind the
        token ids into the token target, the batch's idx_mapping, the new
        rows zeroed (``tok``, ``fills``: other targets than the engine's,
        for the warm-up)."""
        torch = self._torch
        pos_b, val_b, dpos_b, dval_b = slot.views[bi]
        b = self._sizes[bi]
        iota = torch.arange(b, dtype=torch.int64, device=dpos_b.device)  # [b]
        dummy = torch.tensor(self._dummy, dtype=torch.int64, device=dpos_b.device)
        flat = self._flat
        tok = self._tok_target if tok is None else tok
        fills = () if kind == V_PLAIN else self._fills if fills is None else fills

        def work():
            dpos_b.copy_(pos_b, non_blocking=True)
            dval_b.copy_(val_b, non_blocking=True)
            n, n_tok, p = dpos_b[0], dpos_b[1], dpos_b[META:]
            live = (iota >= n_tok) & (iota < n)
            flat.index_copy_(0, torch.where(live, p, dummy), dval_b)
            if kind == V_TOK:  # token ids first in the slot; the rest rewrite the first one
                is_tok = iota < n_tok
                tok.index_copy_(0, torch.where(is_tok, p, p[0]), torch.where(is_tok, dval_b, dval_b[0]))
            if slot.idx is not None:
                slot.didx.copy_(slot.idx, non_blocking=True)
            if fills:
                slot.drows.copy_(slot.rows, non_blocking=True)
                for z in fills:
                    z.index_fill_(0, slot.drows, 0)

        return work

    # -- per step ------------------------------------------------------------

    def begin_step(self):
        """Point the kernels at a free staging slot (waiting only if the ring
        is full); a stale mirror is resynchronized first."""
        if self._stale is not None:
            self.resync()
        if self._open is None:
            slot = self._slots[self._next]
            if slot.pending:
                self.ops.host_wait(slot.event)  # its replay may still be reading it
                slot.pending = False
            self._open = slot
            cv = self.table._cv  # (the context as Python ints: cheaper than numpy scalars)
            cv[T.TB_STG_POS], cv[T.TB_STG_VAL], cv[T.TB_STG_CAP] = slot.addrs
            cv[T.TB_STG_ON] = 1
        self.table._cv[T.TB_STG_N] = 0

    def abort_step(self):
        """Close a step that will ship nothing (rejected, or already ended)."""
        if self._open is not None:
            self._open = None
            self.table._cv[T.TB_STG_ON] = 0

    def end_step(self, n: int, n_tok: int = 0, deduplicate: bool = False, results: bool = True):
        """Ship the first ``n`` staged elements of the open slot (of which
        the first ``n_tok`` are token ids for the token target) and, with
        ``results``, what the step's results add (the batch's idx_mapping,
        the new rows to zero); returns without waiting. A failure of the
        device work leaves the mirror stale (resynchronized by the next
        call) and raises :class:`~mtpstate.MirrorFaultError`."""
        t = self.table
        cv = t._cv
        nb = cv[T.TB_B_N] if results and self._idx_on else -1
        nn = cv[T.TB_RES_NN] if results and self._fills else 0
        if n == 0 and nb < 0 and nn == 0:  # nothing to ship: the slot stays open for the next step
            cv[T.TB_STG_N] = 0
            self._last = None
            return
        slot = self._open
        self._open = None
        self._next = (self._next + 1) % len(self._slots)  # (on the host too: idx_mapping lives ring_depth steps)
        cv[T.TB_STG_ON] = 0  # nothing is staged between steps
        if deduplicate:  # the same element written twice in one step: keep the last write
            p = slot.pos_np[n_tok:n][::-1]
            _, first = np.unique(p, return_index=True)
            keep = n_tok + np.sort(n - n_tok - 1 - first)
            m = n_tok + len(keep)
            pos, val = slot.pos_np[keep], slot.val_np[keep]
            slot.pos_np[n_tok:m] = pos
            slot.val_np[n_tok:m] = val
            n = m
        if self.path == "graph":  # the counts the graph reads on the device
            slot.meta_np[0] = n
            slot.meta_np[1] = n_tok
        if nb >= 0:
            slot.idx_np[:nb] = t._b_idx[:nb]
            self._idx_slot, self._idx_n = slot, nb
        if nn:
            nc = cv[T.TB_RES_NC]
            new = t._res[nc : nc + nn]
            slot.rows_np[:nn] = new
            slot.rows_np[nn:] = new[0]  # padding: the same row zeroed again
        self._nn = nn
        try:
            self._ship(slot, n, n_tok)
        except BaseException as e:
            self._stale = (slot, n, n_tok, nn)
            if isinstance(e, Exception):
                raise MirrorFaultError(
                    f"device mirror: {e!r} while shipping a step to {self.device}; the step was applied to the "
                    "host arrays (do not apply it again); the device tensors are resynchronized in full by the "
                    "next call"
                ) from e
            raise
        self._last = (n, nb >= 0, nn > 0)

    def _ship(self, slot, n, n_tok):
        """The step's device work: one replay (or the same work, issued
        eagerly, or run by the host), then the slot's event."""
        if self.path == "host":
            self._run_on_host(slot, n, n_tok)
            return
        ops = self.ops
        if ops.stream_key() != self._stream_key:
            self._follow_stream()
        if self.path == "graph":
            kind = V_TOK if n_tok else V_NEW if self._nn else V_PLAIN
            ops.replay(slot.graphs[kind, self._bucket(n)][0])
        else:
            self._issue_eagerly(slot, n, n_tok)
        ops.record(slot.event, self._stream)
        slot.pending = True

    def _follow_stream(self):
        """The consumer moved to another stream (or this is the first step):
        its work from now on runs after everything queued on the previous
        one, so steps still apply in order."""
        ops = self.ops
        cur = ops.current_stream()
        if self._stream is not None:
            ops.wait_stream(cur, self._stream)
        self._stream, self._stream_key = cur, ops.stream_key()

    def _issue_eagerly(self, slot, n, n_tok):
        """The graph's work as separate operations (no graph to replay):
        padding written by the host, views made once per bucket."""
        ops = self.ops
        bi = self._bucket(n)
        b = self._sizes[bi]
        slot.pos_np[n:b] = self._dummy
        pos_b, val_b, dpos_b, dval_b = slot.views[bi]
        ops.copy(dpos_b, pos_b)
        ops.copy(dval_b, val_b)
        if n_tok:
            ops.scatter(self._flat, slot.dpos[META + n_tok : META + b], slot.dval[n_tok:b])
            ops.scatter(self._tok_target, slot.dpos[META : META + n_tok], slot.dval[:n_tok])
        else:
            ops.scatter(self._flat, dpos_b[META:], dval_b)
        if slot.idx is not None:
            ops.copy(slot.didx, slot.idx)
        if self._nn:
            ops.copy(slot.drows, slot.rows)
            for z in self._fills:
                ops.fill_rows(z, slot.drows, 0)

    def _run_on_host(self, slot, n, n_tok):
        """The CPU: the host writes the device tensors (the same memory)."""
        self._flat_np[slot.pos_np[n_tok:n]] = slot.val_np[n_tok:n]
        if n_tok:
            self._tok_np[slot.pos_np[:n_tok]] = slot.val_np[:n_tok]
        if self._nn:
            for z in self._fills:
                self.ops.fill_rows(z, slot.rows[: self._nn], 0)

    def resync(self):
        """Bring a stale mirror back (a step's device work failed after the
        host arrays changed): wait for the device, rewrite every region that
        has a host copy, then ship the failed step's staged elements again
        (the engine's lengths and token ids, which have none). Raises
        :class:`~mtpstate.MirrorFaultError` if that fails too (still stale)."""
        if self._stale is None:
            return
        slot, n, n_tok, nn = self._stale
        ops = self.ops
        try:
            self._drain()
            for o, a in self._host_regions():
                src = self._torch.from_numpy(a.copy())
                ops.copy(self._flat[o : o + a.size], src)
            self._nn = nn
            self._ship(slot, n, n_tok)
            self._drain()
        except Exception as e:
            raise MirrorFaultError(
                f"device mirror: {e!r} while resynchronizing after a failed step; the device tensors are stale; "
                "the next call tries again"
            ) from e
        self._stale = None

    @property
    def stale(self) -> bool:
        """True after a step's device work failed, until a call resynchronizes."""
        return self._stale is not None

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
        self.end_step(len(pos), results=False)

    def grow_staging(self, need: int):
        """Reallocate every slot (and recapture its graphs) to hold ``need``."""
        self.synchronize()
        reopen = self._open is not None
        self._open = None
        self._make_slots(max(need, 2 * self._cap))
        if reopen:
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
            ring = self._rows_rings[purpose] = _RowsRing(self, self.table.max_num_reqs, self.ring_depth)
        return ring

    def current_stream(self):
        """The consumer's current stream (the one known from the last step
        when it has not changed: no lookup)."""
        ops = self.ops
        if ops.stream_key() == self._stream_key:
            return self._stream
        return ops.current_stream()

    def synchronize(self):
        self.resync()
        self._drain()

    def _drain(self):
        """Wait until every queued operation has run: no slot or row buffer
        is read by the device any more."""
        self.ops.synchronize()
        for slot in self._slots:
            slot.pending = False
        for ring in self._rows_rings.values():
            ring.pending = [False] * ring.depth

    def stats(self) -> dict:
        """The last step's host-to-device traffic (see ``RequestTable.transfer_stats``)."""
        if self._last is None:
            return {"bytes": 0, "copies": 0, "path": None}
        n, idx, rows = self._last
        if self.path == "host":  # nothing copied: the host writes what changed
            return {"bytes": 12 * n, "copies": 0, "path": "host"}
        b = self._sizes[self._bucket(n)]
        nbytes = 8 * META + 12 * b + 8 * self.table.max_num_reqs * (idx + rows)
        return {"bytes": nbytes, "copies": 2 + idx + rows, "path": self.path}


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
        self.host = [ops.pinned_empty(capacity, torch.int64) for _ in range(depth)]
        self.host_np = [h.numpy() for h in self.host]
        # on the CPU the host buffers are the result
        self.dev = [ops.empty(capacity, torch.int64) for _ in range(depth)] if ops.asynchronous else None
        self.events = [ops.new_event() for _ in range(depth)]
        self.pending = [False] * depth
        self.next = 0
        self.depth = depth
        self.capacity = capacity

    def upload(self, rows):
        k = self.next
        self.next = (k + 1) % self.depth
        n = len(rows)
        if n > self.capacity:
            raise StateError(f"{n} rows exceed max_num_reqs={self.capacity}")
        if self.pending[k]:
            self.ops.host_wait(self.events[k])  # its last copy may still be reading the buffer
            self.pending[k] = False
        self.host_np[k][:n] = rows
        if self.dev is None:
            return self.host[k][:n]
        out = self.dev[k][:n]
        ops = self.ops
        # on the mirror device's current stream (not the current device's)
        ops.copy(out, self.host[k][:n])
        ops.record(self.events[k], self.mirror.current_stream())
        self.pending[k] = True
        return out


class _Tensors:
    """The device tensors, with the host arrays' names and shapes."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    def __repr__(self):
        return f"DeviceTensors({', '.join(self.__dict__)})"
