"""``DeviceMirror``: the public face of the mirror (its options, lifetime and
statistics); the work is in the package's other modules, by concern."""

from __future__ import annotations

import weakref

from mtpstate import devices
from mtpstate.errors import StateError
from mtpstate.mirror.faults import _capturing, _Faults
from mtpstate.mirror.graphs import _Graphs
from mtpstate.mirror.layout import META, MIRRORED_FIELDS, TOKEN_CHUNK, _Layout, step_capacity
from mtpstate.mirror.ship import _Ship
from mtpstate.mirror.views import _Views


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised without torch only
        raise StateError("the device mirror needs torch: pip install 'mtpstate[torch]'") from e
    return torch


class DeviceMirror(_Layout, _Graphs, _Ship, _Faults, _Views):
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

    def synchronize(self):
        self._usable("synchronize")
        self.resync()
        self._drain()

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


def _positive(name, value, default) -> int:
    if value is None:
        return default
    import operator

    v = operator.index(value)
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return v
