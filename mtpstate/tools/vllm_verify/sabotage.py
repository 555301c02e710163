"""Known mutants of mtpstate, for negative controls of the differential
(``mtpstate vllm-verify --sabotage NAME``): each breaks one thing mtpstate
does for vLLM's runner (what the mirror ships, the sampler's answers, its
writes of new requests' params, their upload). With one injected, the
differential must disagree: a check that cannot fail proves nothing."""

from __future__ import annotations


def _zero_token_values(mirror, slot, n, n_tok):
    if n_tok:
        slot.tokens.val_np[: min(n_tok, slot.tokens.capacity)] = 0


def _zero_engine_lengths(mirror, slot, n, n_tok):
    from mtpstate._kernels import slots

    eng = int(mirror.table._ctx[slots.TB_FLAT_ENG])
    pos = slot.state.pos_np[:n]
    slot.state.val_np[:n][(pos >= eng) & (pos < eng + slots.ENG_ROWS * mirror._row_stride)] = 0


def _drop_length_rows(mirror, slot, n, n_tok):
    from mtpstate._kernels import slots

    R = mirror._row_stride  # the device's row stride of the per-request rows
    pos = slot.state.pos_np[:n]
    lengths = (pos >= slots.F_PREFILL * R) & (pos < (slots.F_PROMPT + 1) * R)
    slot.state.pos_np[:n][lengths] = slots.F_MAXSEQ * R  # (a row vLLM does not read)


def _zero_expanded_positions(mirror, slot, n, n_tok):
    from mtpstate._kernels import slots

    cv = mirror.table._cv
    if slot.inputs is not None and cv[slots.TB_B_EXP_OK]:
        slot.views[1][: cv[slots.TB_B_NUM_LOGITS]] = 0  # expanded_local_pos


# negative controls of the patched differential: each corrupts one kind of
# element the mirror ships, just before the copy
SABOTAGE = {
    "tokens": _zero_token_values,
    "engine-lengths": _zero_engine_lengths,
    "lengths": _drop_length_rows,
    "expanded": _zero_expanded_positions,
}


def _skip_last_sampler_row() -> None:
    # the sampler's answers computed without the batch's last row (as if
    # its values were stale)
    from mtpstate.integrations.vllm.sampler import SamplerAnswers

    compute = SamplerAnswers.compute

    def stale(self, idx_addr, n, idx):
        compute(self, idx_addr, max(n - 1, 1), idx)

    SamplerAnswers.compute = stale


def _drop_last_new_params() -> None:
    # the last new request of a step's sampling params never written (its
    # row keeps the previous request's values)
    from mtpstate.integrations.vllm.sampler import SamplingParamsWriter

    flush = SamplingParamsWriter.flush

    def stale(self):
        if self._rows:
            self._rows.pop()
            self._sps.pop()
        flush(self)

    SamplingParamsWriter.flush = stale


def _upload_one_row_less() -> None:
    # the last written row of a step never marked for upload (the device
    # side keeps its previous values)
    from mtpstate.integrations.vllm.sampler import SamplerUploads

    mark = SamplerUploads.mark

    def stale(self, rows):
        mark(self, rows[:-1])

    SamplerUploads.mark = stale


def _count_rows_before_written() -> None:
    # the step's new rows counted as soon as the step is applied, before
    # the add hooks write their sampling params (a reused row's part of the
    # answers stays its previous request's)
    import numpy as np

    from mtpstate._kernels import sampler as K
    from mtpstate.integrations.vllm.sampler import SamplerAnswers

    rows_changed = SamplerAnswers.rows_changed
    nothing = np.zeros(1, np.intp)

    def early(self, table_ctx_addr):
        rows_changed(self, table_ctx_addr)
        K.sp_answers(self._addr, nothing.ctypes.data, 0)  # (counts the dirty rows now)

    SamplerAnswers.rows_changed = early


# negative controls of mtpstate's answers to vLLM's sampler, of its writes
# of new requests' sampling params, and of their upload
SAMPLER_SABOTAGE = {
    "sampler-stale-row": _skip_last_sampler_row,
    "sampler-counted-early": _count_rows_before_written,
    "sampler-params-row": _drop_last_new_params,
    "sampler-upload-row": _upload_one_row_less,
}


# every mutant, by name, with what it breaks
MUTANTS = {
    "tokens": "the mirror ships new requests' token ids as zeros",
    "engine-lengths": "the mirror ships the engine's total_len / num_computed_tokens as zeros",
    "lengths": "the mirror does not ship the prefill / prompt lengths",
    "expanded": "the mirror ships the expanded logits' local positions as zeros",
    "sampler-stale-row": "the sampler's answers leave out the batch's last row",
    "sampler-counted-early": "the sampler's counts take a new row before its params are written",
    "sampler-params-row": "a step's last new request's sampling params are never written",
    "sampler-upload-row": "a step's last written sampler row never reaches the device side",
}
assert set(MUTANTS) == {*SABOTAGE, *SAMPLER_SABOTAGE}


def sabotage(kind: str) -> None:
    """Inject mutant ``kind`` (one of :data:`MUTANTS`) into this process's
    mtpstate; there is no undoing it."""
    if kind not in MUTANTS:
        raise ValueError(f"unknown mutant {kind!r}; one of {', '.join(MUTANTS)}")
    if kind in SAMPLER_SABOTAGE:
        SAMPLER_SABOTAGE[kind]()
        return
    from mtpstate.mirror import DeviceMirror

    ship, corrupt = DeviceMirror._ship, SABOTAGE[kind]

    def corrupted(mirror, slot, n, n_tok):
        corrupt(mirror, slot, n, n_tok)
        ship(mirror, slot, n, n_tok)

    DeviceMirror._ship = corrupted
