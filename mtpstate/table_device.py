"""The table's device side: what its device mirror hands out, and its
lifetime (``RequestTable`` takes these methods from here)."""

from __future__ import annotations

import numpy as np

from mtpstate.errors import StateError


class _DeviceSide:
    """``RequestTable``'s device methods (its ``_mirror``: None without one)."""

    def _device_mirror(self):
        if self._mirror is None:
            raise StateError("this table has no device mirror (pass device=...)")
        return self._mirror

    @property
    def device_tensors(self):
        """torch tensors on ``device`` with the host arrays' names and shapes."""
        return self._device_mirror().tensors

    def upload_rows(self, rows, purpose: str = "rows"):
        """Row numbers (e.g. a batch's ``idx_mapping_np``) as an int64 tensor
        on the mirror's device: one non-blocking copy on the current stream
        from a ring of persistent pinned buffers kept per ``purpose`` (no
        pinned allocation per call; each buffer is refilled only after its
        last copy completed). The tensor is valid for ``ring_depth`` calls
        with the same ``purpose``; StateError without a device mirror or for
        more rows than ``max_num_reqs``."""
        return self._device_mirror().upload_rows(np.asarray(rows), purpose)

    def device_idx_mapping(self):
        """The last step's batch ``idx_mapping`` as an int64 tensor on the
        mirror's device, shipped by the step's own device work (mirror
        option ``idx_mapping=True``). Valid for ``ring_depth`` steps;
        StateError without such a mirror or before a step with a batch."""
        m = self._device_mirror()
        if not m._idx_on:
            raise StateError("this table's mirror does not ship idx_mapping (mirror_options={'idx_mapping': True})")
        return m.idx_mapping()

    def device_batch_inputs(self):
        """The last step's batch inputs on the mirror's device, shipped by the
        step's own device work (mirror option ``query_start_loc_target``):
        ``(query_start_loc, cu_num_logits, zeros)``: the target (all
        ``max_num_reqs + 1`` entries, padded with ``num_tokens``),
        ``cu_num_logits`` (``num_reqs + 1``, int32) and ``num_reqs`` int32
        zeros (vLLM's ``expanded_local_pos`` without drafts; never write into
        them). Valid for ``ring_depth`` steps; StateError without such a
        mirror or before a step with a batch."""
        m = self._device_mirror()
        if m._qsl_target is None:
            raise StateError(
                "this table's mirror does not ship the batch's inputs (mirror_options={'query_start_loc_target': ...})"
            )
        return m.batch_inputs()

    def device_expanded_logits(self):
        """The last step's ``(expanded_idx_mapping, expanded_local_pos)`` on
        the mirror's device (int64 and int32, ``num_logits`` entries each:
        the batch's ``expanded_idx_mapping_np`` / ``expanded_local_pos_np``),
        shipped by the step's own device work with ``cu_num_logits``; None
        when the batch has them None. Valid for ``ring_depth`` steps;
        StateError as :meth:`device_batch_inputs`."""
        self.device_batch_inputs()  # (the same checks)
        return self._mirror.expanded_inputs()

    def synchronize(self) -> None:
        """Wait until every launched copy has landed (a stale mirror is
        resynchronized first: :class:`~mtpstate.MirrorFaultError`)."""
        if self._mirror is not None:
            self._mirror.synchronize()

    def transfer_stats(self) -> dict:
        """The device mirror's traffic and memory.

        ``bytes``, ``copies``, ``replays``: host-to-device traffic of the last
        step (padded to its size buckets; 0 when it shipped nothing), the
        copies and graph replays that carried it. ``path``: how device work
        is issued (``"graph"``, ``"eager"``, ``"host"``; None without a
        mirror), ``graph_error`` why not as graphs where they were wanted.
        ``pinned_bytes``, ``device_bytes`` (of which ``graph_pool_bytes``):
        the host staging (page-locked on CUDA) and device memory the mirror
        holds, all of it allocated when the table was built;
        ``staging_capacity``, ``token_chunk``, ``overflow_chunks``: its sizes.
        """
        if self._mirror is None:
            return {"bytes": 0, "copies": 0, "path": None}
        return self._mirror.stats()

    def close(self) -> None:
        """Release the device mirror's staging after the device work in
        flight that reads it has completed (dropping the table does the same);
        the device tensors stay valid. Later calls that change the table
        raise StateError. Nothing to do without a mirror."""
        if self._mirror is not None:
            self._mirror.close()
