"""The sampler's answers for the step's batch, kept counted over the live
rows (``_kernels.sampler``)."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import sampler as _K


class SamplerAnswers:
    """The sampler's answers for the step's batch (one ``sp_answers`` call).

    ``idx``: the ``idx_mapping_np`` they answer for (None: none). Then
    ``flags`` (``_kernels.sampler.SP_*``), ``max_num_logprobs``,
    ``max_num_token_ids``, ``max_top_k`` (the batch max of top_k, for
    ``return_sampling_mask``), ``max_top_k_top_p`` (top_k's max over rows
    with top_p < 1; -1: none) and ``max_num_bad_words``.

    The live rows' parts of the answers are kept counted (see
    ``_kernels.sampler``): :meth:`rows_changed` after each table step (its
    freed rows out, its new rows to count), :meth:`row_written` for a row
    the sampler's ``add_request`` wrote outside one. A batch of every live
    row is then answered from the counts at any size; any other by a pass
    over its rows. Built with the table, before its first request.
    """

    __slots__ = (
        "idx",
        "flags",
        "max_num_logprobs",
        "max_num_token_ids",
        "max_top_k",
        "max_top_k_top_p",
        "max_num_bad_words",
        "computed",
        "writer",
        "bound",
        "failed",
        "row_live",
        "_arrays",
        "_records",
        "_row_state",
        "_dirty",
        "_ctx",
        "_addr",
    )

    def __init__(self, arrays: tuple, max_num_reqs: int, vocab_size: int):
        # arrays: the per-row arrays, in _K.SP_ARRAYS order (see _arrays)
        R = max_num_reqs
        # held: their addresses are read by the kernels every step
        self._arrays = tuple(arrays)
        self._records = np.zeros((R, _K.REC_COLS), np.int32)  # [R, REC_COLS]: each counted row's part
        self._row_state = np.zeros(R, np.uint8)  # [R]: ROW_*
        self._dirty = np.zeros(R, np.int32)  # [R]: rows to count before the next answers
        ctx = np.zeros(_K.A_SIZE, np.int64)
        ctx[_K.A_R], ctx[_K.A_VOCAB] = R, vocab_size
        ctx[_K.A_ARRAYS : _K.A_ARRAYS + len(_K.SP_ARRAYS)] = [a.ctypes.data for a in self._arrays]
        ctx[_K.A_REC], ctx[_K.A_ROW] = self._records.ctypes.data, self._row_state.ctypes.data
        ctx[_K.A_DIRTY], ctx[_K.A_VALID] = self._dirty.ctypes.data, 1
        ctx[_K.A_MAXV : _K.A_MAXV + _K.N_MAX] = _K.MAX_EMPTY
        self._ctx = ctx
        self._addr = ctx.ctypes.data
        self.idx = None
        self.writer = None  # the SamplingParamsWriter, if new requests' params are written here
        self.bound = []  # (object, name): each wrapper bound on the sampler's objects
        self.failed = None  # failed(phase, error): an error of the writes hands the sampler back (None: raised)
        self.row_live = None  # row_live(row): whether a request holds the row (None: every row counts)
        self.computed = 0  # steps answered (tests, stats)

    def detach(self) -> None:
        """Hand the sampler back to vLLM: the add_request calls noted and not
        yet written go to vLLM's ``add_request`` (in order, so that seeds are
        drawn as vLLM draws them), every wrapper is removed (vLLM's methods
        answer, write and upload again), and the arrays' device side is
        copied whole, as vLLM's ``copy_to_uva`` does."""
        bound, self.bound = self.bound, []
        self.idx = None
        w = self.writer
        if w is not None:
            w.hand_over()
        for obj, name in reversed(bound):
            obj.__dict__.pop(name, None)
        if w is not None and w.uploads is not None:
            w.uploads.detach()

    @property
    def from_counts(self) -> int:
        """Batches answered from the counts (the rest by a pass)."""
        return int(self._ctx[_K.A_FAST])

    def rows_changed(self, table_ctx_addr: int) -> None:
        """A table step was applied (its context's address): its freed rows
        leave the counts, its new rows are counted with the next answers."""
        _K.sp_rows_changed(self._addr, table_ctx_addr)

    def row_written(self, req_idx) -> None:
        """The sampler's ``add_request`` wrote row ``req_idx`` outside a
        table step (a row that is not an int: every batch by a pass)."""
        self.idx = None
        r = req_idx if type(req_idx) is int else -1
        _K.sp_row_written(self._addr, r)

    def compute(self, idx_addr: int, n: int, idx: np.ndarray) -> None:
        """Answer for the ``n`` rows at ``idx_addr`` (intp; the step's batch:
        distinct live rows), whose copy ``idx`` is the ``idx_mapping_np``
        vLLM's sampler will be asked with."""
        if self.writer is not None:
            self.writer.flush()  # (add_request calls not yet written)
        if n == 0:  # (vLLM's reductions over an empty batch raise: its own code answers)
            self.idx = None
            return
        (
            self.flags,
            self.max_num_logprobs,
            self.max_num_token_ids,
            self.max_top_k,
            self.max_top_k_top_p,
            self.max_num_bad_words,
        ) = _K.sp_answers(self._addr, idx_addr, n)
        self.idx = idx
        self.computed += 1
