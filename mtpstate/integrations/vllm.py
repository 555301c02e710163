"""Glue for vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``, vLLM 0.34).

``ModelRunnerV2State(runner)`` takes over the host side of a
``GPUModelRunner``'s request state: its ``RequestState`` (states.py) and
``BlockTables`` (block_table.py) host arrays become views of one
:class:`mtpstate.RequestTable`, and a scheduler step is applied by one
``RequestTable.apply`` instead of the per-request loops of
``finish_requests`` / ``add_requests`` / ``update_requests``. What stays per
request is what must: the runner's hooks for requests that leave or arrive
(``_remove_request``: model state, pooling, ``pp_handler.on_req_idx_freed``,
encoder cache, LoRA; and the add hooks: model state, sampler, speculator,
...), and the staging of their token ids into vLLM's tensors (block tables
go through the table's device mirror).

Imports no vLLM: it works on the runner object it is given. The worked patch
``integrations/vllm/mtpstate-mrv2.patch`` shows the calls in the runner;
``docs/vllm.md`` maps every field.
"""

from __future__ import annotations

import numpy as np

from mtpstate.table import RequestTable, StepResult

__all__ = ["ModelRunnerV2State"]


class _Step:
    """The step as the table reads it: the runner frees ``finished`` (finished,
    preempted, and new ids still live: a streaming-input update re-adds them)."""

    __slots__ = (
        "finished_req_ids",
        "preempted_req_ids",
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        "scheduled_spec_decode_tokens",
        "total_num_scheduled_tokens",
    )

    def __init__(self, finished, so):
        self.finished_req_ids = finished
        self.preempted_req_ids = None
        self.scheduled_new_reqs = so.scheduled_new_reqs
        self.scheduled_cached_reqs = so.scheduled_cached_reqs
        self.num_scheduled_tokens = getattr(so, "num_scheduled_tokens", None)
        self.scheduled_spec_decode_tokens = getattr(so, "scheduled_spec_decode_tokens", None)
        self.total_num_scheduled_tokens = getattr(so, "total_num_scheduled_tokens", None)


class ModelRunnerV2State:
    """Request state of a vLLM Model Runner V2 ``GPUModelRunner``, kept by a
    :class:`RequestTable`.

    Parameters
    ----------
    runner
        The ``GPUModelRunner`` (or any object with its ``req_states``,
        ``block_tables`` and ``_remove_request``), after both were built.

    ring_depth
        Staging slots of the table's device mirror: at least the engine's
        batch queue depth (2 with async scheduling).

    Notes
    -----
    After construction these runner arrays are views of the table (same
    dtypes and shapes, so every reader in the runner is unchanged):
    ``req_states.num_computed_tokens_np``, ``num_computed_prefill_tokens``,
    ``max_seq_len``, ``prompt_len.np``, ``prefill_len.np`` and
    ``block_tables.num_blocks.np``; the device block tables
    (``block_tables.block_tables[g].gpu``) are the mirror's tensors, same
    dtype and shape, written only by the mirror's per-step copy.
    ``req_states.req_id_to_index`` /
    ``index_to_req_id`` are still kept (the runner reads them elsewhere), but
    only requests that arrive or leave touch them. Rows are the table's
    (lowest free first), not vLLM's LIFO free list: the same on every
    tensor-parallel rank.
    """

    def __init__(self, runner, ring_depth: int = 2):
        rs, bt = runner.req_states, runner.block_tables
        widths = [t.gpu.shape[1] for t in bt.block_tables]
        self.runner = runner
        # the block tables live in the table's device mirror: each step's
        # appends reach the device in the mirror's one staged copy, instead of
        # one StagedWriteTensor write per request; token ids stay vLLM's (UVA
        # by default), staged per new request as MRV2 does
        self.table = RequestTable(
            max_num_reqs=rs.max_num_reqs,
            max_model_len=rs.max_model_len,
            block_sizes=list(bt.block_sizes),
            max_num_blocks_per_group=widths,
            device=rs.device,
            mirror_options={"ring_depth": ring_depth, "token_ids_on_device": False},
            # the step's batch (gather_batch_req_state's BatchReqState) in the same call
            decode_query_len=getattr(runner, "decode_query_len", None),
        )
        self._batch = None
        t = self.table
        # the runner reads these every step; as views, apply's writes are theirs
        rs.num_computed_tokens_np = t.num_computed_tokens  # [max_num_reqs]
        rs.num_computed_prefill_tokens = t.num_computed_prefill_tokens  # [max_num_reqs]
        rs.max_seq_len = t.max_seq_len  # [max_num_reqs]
        rs.prompt_len.np = t.prompt_len  # copy_to_uva() reads .np
        rs.prefill_len.np = t.prefill_len
        bt.num_blocks.np = t.num_blocks  # [num_groups, max_num_reqs]
        for g, dev in enumerate(t.device_tensors.block_tables):  # [max_num_reqs, W_g] each
            bt.block_tables[g].gpu = dev
        bt.init_block_table_layout_tensors()  # the kernels' pointer/stride tables
        rs.external_rows = True  # the patched RequestState keeps no free list
        self._freeing: list[str] = []

    # -- the three runner methods ---------------------------------------------

    def finish(self, scheduler_output) -> None:
        """``finish_requests``: run the runner's per-request removal hooks
        (they need the rows, which stay valid until :meth:`apply`), in sorted
        id order as vLLM does, so that ranks agree. Unknown ids are ignored."""
        rs = self.runner.req_states
        gone = set(scheduler_output.finished_req_ids)
        gone.update(scheduler_output.preempted_req_ids or ())
        gone.update(r.req_id for r in scheduler_output.scheduled_new_reqs if r.req_id in rs.req_id_to_index)
        self._freeing = sorted(gone)
        for req_id in self._freeing:
            self.runner._remove_request(req_id)

    def apply(self, scheduler_output) -> StepResult:
        """``add_requests`` + ``update_requests``: apply the step (finish, add,
        update) with one ``RequestTable.apply``, whose mirror also ships every
        block-table change to the device; then stage the new requests' token
        ids and lengths into vLLM's tensors as MRV2 does. Returns the table's
        :class:`StepResult` (``new_rows`` in the order of
        ``scheduled_new_reqs``, for the runner's add hooks)."""
        so = scheduler_output
        rs = self.runner.req_states
        res = self.table.apply(_Step(self._freeing, so))
        self._freeing = []
        self._batch = res.batch
        new = so.scheduled_new_reqs
        if new:
            prefill_len = self.table.prefill_len
            rows = res.new_rows.tolist()
            for r, row in zip(new, rows):
                rs.req_id_to_index[r.req_id] = row
                rs.index_to_req_id[row] = r.req_id
                rs.total_len.stage_write_elem(row, int(prefill_len[row]))
                rs.all_token_ids.stage_write(row, 0, r.prefill_token_ids)  # by reference, as vLLM does
                rs.num_computed_tokens.stage_write_elem(row, r.num_computed_tokens)
            if rs.num_speculative_steps > 0:
                # the new rows' draft tokens zeroed in one op (vLLM: one
                # draft_tokens[row].zero_() per new request)
                import torch

                idx = torch.tensor(rows, dtype=torch.int64).to(rs.draft_tokens.device, non_blocking=True)
                rs.draft_tokens.index_fill_(0, idx, 0)
        return res

    def accepts_request_id(self, req_id) -> bool:
        """Whether a request with this id can run (see
        :meth:`RequestTable.accepts_request_id`): check it when the request
        is admitted, and reject that request alone, instead of letting the
        step that adds it fail for every running request."""
        return self.table.accepts_request_id(req_id)

    @property
    def batch(self):
        """The last applied step's :class:`~mtpstate.table.BatchReqState`
        (None when the runner has no ``decode_query_len``)."""
        return self._batch

    def batch_req_state(self, cls, use_pp: bool = False):
        """The step's batch as vLLM's ``BatchReqState`` (``cls``, so that
        this module imports no vLLM), for ``gather_batch_req_state``: the
        arrays copied (vLLM's ``InputBatch`` keeps them past the next step's
        apply), ``max_seq_len_np`` only with pipeline parallelism and a
        prefill, as vLLM fills it."""
        b = self._batch
        drafts = b.num_draft_tokens_np
        as_decode = b.prefill_runs_as_decode_np
        has_prefill = b.has_prefill
        return cls(
            req_ids=b.req_ids,
            num_scheduled_tokens=b.num_scheduled_tokens.copy(),
            num_tokens=b.num_tokens,
            num_draft_tokens_np=None if drafts is None else drafts.copy(),
            idx_mapping_np=b.idx_mapping_np.copy(),
            prefill_len_np=b.prefill_len_np.copy(),
            num_computed_prefill_tokens_np=b.num_computed_prefill_tokens_np.copy(),
            is_prefilling_np=b.is_prefilling_np.copy(),
            max_seq_len_np=b.max_seq_len_np.copy() if use_pp and has_prefill else None,
            has_prefill=has_prefill,
            prefill_runs_as_decode_np=None if as_decode is None else as_decode.copy(),
            decode_graph_eligible=b.decode_graph_eligible,
        )

    def batch_rows(self, req_ids) -> np.ndarray:
        """Rows of ``req_ids`` (the batch order of ``gather_batch_req_state``)
        as the ``np.intp`` array ``idx_mapping_np``: the step's batch when
        ``req_ids`` is its order (no lookup at all), else one batched lookup."""
        b = self._batch
        if b is not None and (req_ids is b.req_ids or req_ids == b.req_ids):
            return b.idx_mapping_np
        return self.table.rows(req_ids).astype(np.intp)

    def idx_mapping(self, req_ids, device):
        """The batch -> row mapping as an int64 tensor on ``device``, ready for
        ``prepare_inputs``: built on the host, then one non-blocking copy from
        pinned memory when ``device`` is a GPU (what vLLM's
        ``async_tensor_h2d`` does with ``idx_mapping_np``)."""
        import torch

        host = torch.from_numpy(self.batch_rows(req_ids).astype(np.int64))
        dev = torch.device(device)
        if dev.type == "cpu":
            return host
        return host.pin_memory().to(dev, non_blocking=True)
