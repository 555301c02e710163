"""Device mirror: each step's changes reach torch tensors in one asynchronous
copy.

The host arrays stay the source of truth. The step kernels append every
element they change, as (flat position, value), to a staging slot; ``end_step``
ships the slot with two ``non_blocking`` copies (positions int64, values
int32: 12 bytes per changed element) and applies it on the device with one
scatter into a single flat int32 tensor, of which every device tensor is a
view. Bytes per step grow with what changed, not with ``max_num_reqs``.

Staging slots form a ring (depth = the engine's number of in-flight steps).
A slot's pinned buffers are refilled only after the CUDA event recorded after
its copy has completed: refilling a pinned buffer while a ``non_blocking``
copy still reads it silently corrupts the device data. The host waits only
when the ring is full. Pinned memory is used only for CUDA targets (on a
CPU-only torch build ``pin_memory`` is unavailable, and a ``non_blocking``
copy from pageable memory would silently be synchronous anyway); on
``device="cpu"`` the same staging and scatter path runs, which is what CI
exercises.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import step as T
from mtpstate.errors import StateError

__all__ = ["DeviceMirror"]


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised without torch only
        raise StateError("the device mirror needs torch: pip install 'mtpstate[torch]'") from e
    return torch


class _Slot:
    """One staging slot: host buffers, and the event that says the copy that
    read them has completed."""

    def __init__(self, torch, capacity, pinned):
        self.pos = torch.empty(capacity, dtype=torch.int64, pin_memory=pinned)
        self.val = torch.empty(capacity, dtype=torch.int32, pin_memory=pinned)
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
        False: it stays in host memory (pinned when the device is CUDA, so
        kernels can read it directly); ``device_tensors.token_ids`` is then
        that host tensor.
    staging_capacity : int, optional
        Initial elements per slot; grown on demand.
    """

    def __init__(self, table, device, ring_depth: int = 2, token_ids_on_device: bool = True, staging_capacity=None):
        torch = _torch()
        self._torch = torch
        self.device = torch.device(device)
        if ring_depth < 2:
            raise ValueError("ring_depth must be >= 2")
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and not torch.cuda.is_available():
            raise StateError(f"device {device!r} requested but CUDA is not available")
        self.table = table
        self.ring_depth = ring_depth
        self.token_ids_on_device = token_ids_on_device
        R, L = table.max_num_reqs, table.max_model_len
        self._host_tok_tensor = None
        if not token_ids_on_device:
            self._host_tok_tensor = torch.zeros((R, L), dtype=torch.int32, pin_memory=self.is_cuda)
        cap = staging_capacity or max(1024, 4 * R)
        self._slots = [_Slot(torch, cap, self.is_cuda) for _ in range(ring_depth)]
        self._next = 0
        self._open = None
        self._stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        self._last = {"bytes": 0, "copies": 0}

    # the table asks for this before it allocates its own token_ids
    @property
    def host_token_ids(self):
        return None if self._host_tok_tensor is None else self._host_tok_tensor.numpy()

    def attach(self):
        """Lay out the flat device tensor and copy the current host state
        (once, at construction)."""
        torch = self._torch
        t = self.table
        R, L, ng = t.max_num_reqs, t.max_model_len, t.num_groups
        offsets = []
        off = (T.F_NB + ng) * R
        for w in t.max_num_blocks_per_group:
            offsets.append(off)
            off += R * w
        t._flat_bt[:] = offsets
        tok_off = -1
        if self.token_ids_on_device:
            tok_off = off
            off += R * L
        t._ctx[T.TB_FLAT_TOK] = tok_off
        self._flat = torch.zeros(off, dtype=torch.int32, device=self.device)  # [total elements]
        host = [t._state.reshape(-1), *(bt.reshape(-1) for bt in t.block_tables)]
        if self.token_ids_on_device:
            host.append(t.token_ids.reshape(-1))
        self._flat.copy_(torch.from_numpy(np.concatenate(host)))
        f = self._flat
        names = ["num_computed_tokens", "num_computed_prefill_tokens", "prefill_len", "prompt_len", "max_seq_len"]
        self.tensors = _Tensors(
            **{name: f[i * R : (i + 1) * R] for i, name in enumerate(names)},
            num_blocks=f[T.F_NB * R : (T.F_NB + ng) * R].view(ng, R),
            block_tables=[f[o : o + R * w].view(R, w) for o, w in zip(offsets, t.max_num_blocks_per_group)],
            token_ids=f[tok_off : tok_off + R * L].view(R, L) if tok_off >= 0 else self._host_tok_tensor,
        )
        self._alloc_device_buffers(len(self._slots[0].pos))

    def _alloc_device_buffers(self, cap):
        torch = self._torch
        self._dev_pos = torch.empty(cap, dtype=torch.int64, device=self.device)
        self._dev_val = torch.empty(cap, dtype=torch.int32, device=self.device)
        if not self.is_cuda:  # numpy views of the CPU "device" memory
            self._dev_pos_np = self._dev_pos.numpy()
            self._dev_val_np = self._dev_val.numpy()
            self._flat_np = self._flat.numpy()

    # -- per step ------------------------------------------------------------

    def begin_step(self):
        """Point the kernels at a free staging slot (waiting only if the ring
        is full)."""
        if self._open is None:
            slot = self._slots[self._next]
            if slot.event is not None:
                slot.event.synchronize()  # its copy may still be reading it
                slot.event = None
            self._open = slot
            ctx = self.table._ctx
            ctx[T.TB_STG_POS], ctx[T.TB_STG_VAL], ctx[T.TB_STG_CAP] = slot.addrs
            ctx[T.TB_STG_ON] = 1
        self.table._ctx[T.TB_STG_N] = 0

    def abort_step(self):
        """Close a step that will ship nothing (rejected, or already ended)."""
        if self._open is not None:
            self._open = None
            self.table._ctx[T.TB_STG_ON] = 0

    def end_step(self, n: int, deduplicate: bool = False):
        """Ship the first ``n`` staged elements of the open slot and scatter
        them into the device tensors; returns without waiting."""
        slot = self._open
        self._open = None
        self._next = (self._next + 1) % len(self._slots)
        self.table._ctx[T.TB_STG_ON] = 0  # nothing is staged between steps
        if n == 0:
            self._last = {"bytes": 0, "copies": 0}
            return
        pos, val = slot.pos[:n], slot.val[:n]
        if deduplicate:  # the same element written twice in one step: keep the last write
            p = slot.pos_np[:n][::-1]
            _, first = np.unique(p, return_index=True)
            keep = np.sort(n - 1 - first)
            m = len(keep)
            slot.pos_np[:m] = slot.pos_np[keep]
            slot.val_np[:m] = slot.val_np[keep]
            n = m
            pos, val = slot.pos[:n], slot.val[:n]
        torch = self._torch
        if self.is_cuda:
            stream = self._stream
            # the copy must not overtake device work already queued on the
            # consumer's stream that reads these tensors
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                dpos = self._dev_pos[:n]
                dval = self._dev_val[:n]
                dpos.copy_(pos, non_blocking=True)
                dval.copy_(val, non_blocking=True)
                self._flat.index_copy_(0, dpos, dval)
                slot.event = torch.cuda.Event()
                slot.event.record(stream)
            # the consumer's later work sees the update, without a host wait
            torch.cuda.current_stream(self.device).wait_stream(stream)
        else:
            # the same two copies and scatter, done by the host (no stream)
            dpos = self._dev_pos_np[:n]
            dval = self._dev_val_np[:n]
            dpos[:] = slot.pos_np[:n]
            dval[:] = slot.val_np[:n]
            self._flat_np[dpos] = dval
        self._last = {"bytes": n * (8 + 4), "copies": 2}

    def stage_arrays(self, staged):
        """Stage changes made outside the kernels (the array entry point)."""
        pos = np.concatenate([np.asarray(p, np.int64) for p, _ in staged])
        val = np.concatenate([np.asarray(v, np.int32) for _, v in staged])
        self.begin_step()
        if len(pos) > len(self._open.pos_np):
            self.grow_staging(len(pos))
        self._open.pos_np[: len(pos)] = pos
        self._open.val_np[: len(val)] = val
        self.end_step(len(pos))

    def grow_staging(self, need: int):
        """Reallocate every slot (and the device buffers) to hold ``need``."""
        self.synchronize()
        torch = self._torch
        cap = max(need, 2 * len(self._slots[0].pos))
        self._slots = [_Slot(torch, cap, self.is_cuda) for _ in range(len(self._slots))]
        self._alloc_device_buffers(cap)
        if self._open is not None:
            self._open = None
            self.begin_step()

    def synchronize(self):
        for slot in self._slots:
            if slot.event is not None:
                slot.event.synchronize()
                slot.event = None
        if self._stream is not None:
            self._stream.synchronize()

    def stats(self) -> dict:
        return dict(self._last)


class _Tensors:
    """The device tensors, with the host arrays' names and shapes."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    def __repr__(self):
        return f"DeviceTensors({', '.join(self.__dict__)})"
