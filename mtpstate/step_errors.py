"""Kernel status -> the StateError a user reads: the failing request named
from the error context (its phase and position in the step), the field, and
what was wrong with it."""

from __future__ import annotations

from mtpstate._kernels import slots as T
from mtpstate._kernels import status as K
from mtpstate.binding import Step, _short
from mtpstate.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidStepError,
    StateError,
    UnknownRequestError,
)
from mtpstate.index import key_text

__all__ = ["raise_step_error"]

_FIELD_NAMES = {
    K.FLD_NONE: "",
    K.FLD_REQ_ID: "req_id",
    K.FLD_PROMPT_LEN: "prompt_len",
    K.FLD_TOKENS: "prefill_token_ids",
    K.FLD_NCT: "num_computed_tokens",
    K.FLD_MAX_TOKENS: "sampling_params.max_tokens",
    K.FLD_BLOCKS: "block_ids",
    K.FLD_COUNT: "num_scheduled_tokens",
    K.FLD_DRAFTS: "scheduled_spec_decode_tokens",
    K.FLD_TOTAL: "total_num_scheduled_tokens",
}
_PHASE_NAMES = {
    K.PH_FINISH: "finished request",
    K.PH_PREEMPT: "preempted request",
    K.PH_NEW: "new request",
    K.PH_CACHED: "cached request",
    K.PH_RESUMED: "resumed request",
    K.PH_BATCH: "scheduled request",
    K.PH_SPEC: "scheduled_spec_decode_tokens entry",
}


def raise_step_error(table, status: int, b: Step) -> None:
    """Raise the StateError for a kernel status other than OK, naming the
    request (from the error context: phase, position) and the field."""
    ctx = table._ctx
    pos, arg = int(ctx[T.TB_ERR_POS]), int(ctx[T.TB_ERR_ARG])
    phase, field = int(ctx[T.TB_ERR_PHASE]), int(ctx[T.TB_ERR_FIELD])
    if phase == K.PH_NEW:
        ids = [r.req_id for r in b.new]
    elif phase == K.PH_BATCH:
        ids = list(b.nst) if b.nst is not None else None
    elif phase == K.PH_SPEC:
        ids = list(b.spec) if b.spec is not None else None
    else:
        ids = {K.PH_FINISH: b.fin, K.PH_PREEMPT: b.pre, K.PH_CACHED: b.cid, K.PH_RESUMED: b.cres}.get(phase)
    rid = key_text(ids[pos]) if (ids is not None and 0 <= pos < len(ids)) else None
    fname = _FIELD_NAMES.get(field, "")
    if phase == K.PH_CACHED and field == K.FLD_BLOCKS:
        fname = "new_block_ids"
    what = _PHASE_NAMES.get(phase, "request")
    who = f"{what} {rid!r}" if rid is not None else f"{what}s"
    at = f"{who}, field {fname}" if fname else who
    L = table.max_model_len
    if status == K.E_UNKNOWN:
        if phase == K.PH_BATCH:
            raise UnknownRequestError(rid, "scheduled (num_scheduled_tokens) but not live after the step")
        raise UnknownRequestError(rid, "finished or preempted in this step" if arg else "not live")
    if status == K.E_CHANGED:
        raise InvalidStepError(f"{_FIELD_NAMES[K.FLD_COUNT]} changed while the step was applied")
    if status == K.E_COUNT_VALUE:
        value = f"={arg}" if arg != -1 else " (out of int64 range)"
        raise InvalidStepError(f"{at}: num_scheduled_tokens{value} outside [0, 2**31)")
    if status == K.E_TOTAL:
        raise InvalidStepError(f"total_num_scheduled_tokens={_short(b.total)} but num_scheduled_tokens sum to {arg}")
    if status == K.E_BATCH_SIZE:
        raise InvalidStepError(f"num_scheduled_tokens has {arg} entries, more than max_num_reqs={table.max_num_reqs}")
    if status == K.E_DUPLICATE:
        if phase == K.PH_NEW:
            raise DuplicateRequestError(f"new request id {rid!r} appears twice in the step")
        if pos < 0:
            raise DuplicateRequestError(f"{arg} cached requests exceed max_num_reqs={table.max_num_reqs}")
        if phase == K.PH_BATCH:
            raise DuplicateRequestError(f"scheduled request {rid!r} has the row of another scheduled id")
        raise DuplicateRequestError(f"cached request {rid!r} is listed twice in the step")
    if status == K.E_CAPACITY:
        free = table.max_num_reqs - len(table._index)
        raise CapacityError(f"{arg} new requests but only {free} free rows (+ rows freed by this step)")
    if status == K.E_LENGTHS:
        raise InvalidStepError(f"scheduled_cached_reqs: {fname} has {arg} entries, req_ids has {len(b.cid)}")
    if status == K.E_ID_TOO_LONG:
        raise InvalidStepError(
            f"{what} id of {arg} bytes exceeds max_id_bytes={table._index.max_id_bytes}: {_short(rid)}"
        )
    if status == K.E_NCT_RANGE:
        value = f"={arg}" if arg else " (out of int64 range)"
        raise InvalidStepError(f"{at}: num_computed_tokens{value} outside [0, max_model_len={L}]")
    if status == K.E_NEW_NCT_RANGE:
        value = f"={arg}" if arg != -1 else " (out of int64 range)"
        raise InvalidStepError(f"{at}: num_computed_tokens{value} outside [0, prefill length]")
    if status == K.E_TOO_LONG:
        value = f"{arg}" if arg >= 0 else "out of range"
        raise InvalidStepError(f"{at}: length {value} outside [0, max_model_len={L}]")
    if status == K.E_MAX_TOKENS:
        raise InvalidStepError(f"{at}: max_tokens is negative or prompt_len + max_tokens overflows int32")
    if status == K.E_TOKEN_VALUE:
        raise InvalidStepError(f"{at}: token ids must be ints in [0, 2**31) (token #{arg})")
    if status == K.E_GROUPS:
        raise InvalidStepError(f"{at}: block ids for {arg} KV-cache groups, the table has {table.num_groups}")
    if status == K.E_BLOCK_OVERFLOW:
        raise InvalidStepError(
            f"{at}: block table of group {arg} overflows its {table.max_num_blocks_per_group[arg]} blocks"
        )
    if status == K.E_BLOCK_VALUE:
        raise InvalidStepError(f"{at}: block ids of group {arg} must be ints in [0, 2**31)")
    if status == K.E_NOT_CANONICAL:
        raise InvalidStepError(f"{at}: unsupported value")
    raise StateError(f"internal error: kernel status {status} at {at} (position {pos})")  # pragma: no cover
