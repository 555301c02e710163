"""The sampler's per-step answers over a batch, from an engine's per-row
sampling arrays read by address (vLLM's ``SamplingStates`` /
``PenaltiesState`` / ``Sampler`` arrays), instead of a fancy index and a
reduction per question.

Each row's part of the answers is its record: its flags and its five
values whose batch maxima are asked (``_record``). A row's values change
only when a request is added at it, so the records of the live rows are
kept, counted: how many rows have each flag, each maximum and how many
rows hold it. A batch of every live row (every step in steady serving) is
answered from the counts, whatever its size; the rows added since are
counted first, and the freed ones were taken out when the step freed
them. Any other batch is answered by one pass over its rows.

The answers are bit flags plus maxima; ``mtpstate.integrations.vllm``'s
sampler glue turns them into the values vLLM's methods return. Comparisons
are numpy's: float32 values against the exact constants 0, 1 (a NaN
temperature is neither, so temperature "applies", as ``np.all`` says).
"""

from __future__ import annotations

from mtpstate._kernels import slots as T
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import view_f32, view_i32, view_i64, view_u8

# flags (bit i set: the batch has at least one such row)
SP_ANY_GREEDY = 1  # temperature == 0
SP_ANY_SEED = 2  # seeds_set
SP_DO_TOP_K = 4  # top_k != vocab
SP_DO_TOP_P = 8  # top_p != 1
SP_TEMPERATURE = 16  # temperature not in {0, 1}: apply_temperature launches
SP_MIN_P = 32  # min_p != 0: apply_min_p launches
SP_NEEDS_PROCESSING = 64  # needs_logits_processing
SP_USE_PENALTY = 128  # use_penalty
SP_USE_LOGIT_BIAS = 256  # use_logit_bias
SP_USE_THINKING_BUDGET = 512  # use_thinking_budget
SP_RESTORE_WHEN_MASKED = 1024  # restore_when_all_masked: the logit-bias kernel's stop-token restore
N_FLAGS = 11

# the per-row arrays read, in this order (each [max_num_reqs])
SP_ARRAYS = (
    "temperature",  # float32
    "top_k",  # int32
    "top_p",  # float32
    "min_p",  # float32
    "seeds_set",  # bool
    "num_logprobs",  # int32
    "needs_logits_processing",  # bool
    "use_penalty",  # bool
    "num_token_ids",  # int32
    "use_logit_bias",  # bool
    "num_bad_words",  # int32
    "use_thinking_budget",  # bool
    "restore_when_all_masked",  # int32
)

# a row's record (int32 [REC_COLS]): its flags, then its values of the
# maxima asked: num_logprobs, num_token_ids, top_k, top_k if top_p < 1
# (else -1), num_bad_words
REC_FLAGS = 0
REC_MAX = 1
N_MAX = 5
REC_COLS = REC_MAX + N_MAX
# each maximum over no row (num_token_ids' and top_k-under-top_p's are
# reported as 0 and -1 for a batch without a larger value)
MAX_EMPTY = (-(1 << 31), 0, -(1 << 31), -1, -(1 << 31))

# a row's state (uint8): its record is counted; it was written since
ROW_COUNTED = 1
ROW_DIRTY = 2
ROW_LISTED = 4  # (scratch of _compact_dirty)

# the counted state (int64 context, sp_answers' and sp_rows_changed's first argument)
A_R = 0  # max_num_reqs
A_VOCAB = 1
A_ARRAYS = 2  # the arrays' addresses, SP_ARRAYS order
A_REC = A_ARRAYS + len(SP_ARRAYS)  # addr int32[R, REC_COLS]: the records
A_ROW = A_REC + 1  # addr uint8[R]: ROW_* per row
A_DIRTY = A_ROW + 1  # addr int32[R]: rows to (re)count before answering
A_NDIRTY = A_DIRTY + 1
A_VALID = A_NDIRTY + 1  # 1: every live row is counted or dirty (0: a row written was not known: every batch by a pass)
A_COUNT = A_VALID + 1  # rows counted
A_STALE = A_COUNT + 1  # bit j: maximum j to recompute (its last holder left)
A_FAST = A_STALE + 1  # batches answered from the counts (stats, tests)
A_BITS = A_FAST + 1  # [N_FLAGS]: counted rows with flag bit j
A_MAXV = A_BITS + N_FLAGS  # [N_MAX]: the maxima over the counted rows
A_ATMAX = A_MAXV + N_MAX  # [N_MAX]: how many counted rows hold each
A_SIZE = A_ATMAX + N_MAX


@jit
def _arrays(a, R):
    # the per-row arrays, SP_ARRAYS order
    b = A_ARRAYS
    return (
        view_f32(a[b], R),
        view_i32(a[b + 1], R),
        view_f32(a[b + 2], R),
        view_f32(a[b + 3], R),
        view_u8(a[b + 4], R),
        view_i32(a[b + 5], R),
        view_u8(a[b + 6], R),
        view_u8(a[b + 7], R),
        view_i32(a[b + 8], R),
        view_u8(a[b + 9], R),
        view_i32(a[b + 10], R),
        view_u8(a[b + 11], R),
        view_i32(a[b + 12], R),
    )


@jit
def _record(arrs, r, vocab):
    """Row ``r``'s part of the answers: (flags, num_logprobs, num_token_ids,
    top_k, top_k if top_p < 1 else -1, num_bad_words)."""
    t = arrs[0][r]
    k = arrs[1][r]
    p = arrs[2][r]
    flags = 0
    if t == 0.0:
        flags |= SP_ANY_GREEDY
    elif t != 1.0:
        flags |= SP_TEMPERATURE
    if k != vocab:
        flags |= SP_DO_TOP_K
    if p != 1.0:
        flags |= SP_DO_TOP_P
    if arrs[3][r] != 0.0:
        flags |= SP_MIN_P
    if arrs[4][r] != 0:
        flags |= SP_ANY_SEED
    if arrs[6][r] != 0:
        flags |= SP_NEEDS_PROCESSING
    if arrs[7][r] != 0:
        flags |= SP_USE_PENALTY
    if arrs[9][r] != 0:
        flags |= SP_USE_LOGIT_BIAS
    if arrs[11][r] != 0:
        flags |= SP_USE_THINKING_BUDGET
    if arrs[12][r] != 0:
        flags |= SP_RESTORE_WHEN_MASKED
    k_p = k if p < 1.0 else -1
    return flags, arrs[5][r], arrs[8][r], k, k_p, arrs[10][r]


@jit
def _batch_pass(arrs, idx, n, vocab):
    # the answers for the batch, row by row
    flags = 0
    m0, m1, m2, m3, m4 = MAX_EMPTY
    for i in range(n):
        f, v0, v1, v2, v3, v4 = _record(arrs, idx[i], vocab)
        flags |= f
        m0 = max(m0, v0)
        m1 = max(m1, v1)
        m2 = max(m2, v2)
        m3 = max(m3, v3)
        m4 = max(m4, v4)
    return flags, m0, m1, m2, m3, m4


@jit
def _take_max(a, j, v):
    # a counted row's value v of maximum j
    if v > a[A_MAXV + j]:
        a[A_MAXV + j] = v
        a[A_ATMAX + j] = 1
    elif v == a[A_MAXV + j]:
        a[A_ATMAX + j] += 1


@jit
def _count(a, rec, r):
    # row r's record into the counts
    f = rec[r, REC_FLAGS]
    for j in range(N_FLAGS):
        if f & (1 << j):
            a[A_BITS + j] += 1
    stale = a[A_STALE]
    for j in range(N_MAX):
        if stale & (1 << j):
            continue  # (recomputed over every counted row when asked)
        _take_max(a, j, rec[r, REC_MAX + j])
    a[A_COUNT] += 1


@jit
def _uncount(a, rec, r):
    # row r's record out of the counts
    f = rec[r, REC_FLAGS]
    for j in range(N_FLAGS):
        if f & (1 << j):
            a[A_BITS + j] -= 1
    a[A_COUNT] -= 1
    if a[A_COUNT] == 0:  # nothing counted: every maximum is the empty one
        for j in range(N_MAX):
            a[A_MAXV + j] = MAX_EMPTY[j]
            a[A_ATMAX + j] = 0
        a[A_STALE] = 0
        return
    for j in range(N_MAX):
        if not a[A_STALE] & (1 << j) and rec[r, REC_MAX + j] == a[A_MAXV + j]:
            a[A_ATMAX + j] -= 1
            if a[A_ATMAX + j] == 0:
                a[A_STALE] |= 1 << j


@jit
def _recount_maxima(a, rec, state, R):
    # the stale maxima, over every counted row
    stale = a[A_STALE]
    for j in range(N_MAX):
        if stale & (1 << j):
            a[A_MAXV + j] = MAX_EMPTY[j]
            a[A_ATMAX + j] = 0
    for r in range(R):
        if not state[r] & ROW_COUNTED:
            continue
        for j in range(N_MAX):
            if stale & (1 << j):
                _take_max(a, j, rec[r, REC_MAX + j])
    a[A_STALE] = 0


@jit
def _count_dirty(a, arrs, rec, state, vocab):
    # every row written since: its record (re)computed and counted
    dirty = view_i32(a[A_DIRTY], a[A_R])
    for i in range(a[A_NDIRTY]):
        r = dirty[i]
        if not state[r] & ROW_DIRTY:
            continue  # (freed since, or listed twice)
        if state[r] & ROW_COUNTED:
            _uncount(a, rec, r)
        f, v0, v1, v2, v3, v4 = _record(arrs, r, vocab)
        rec[r, REC_FLAGS] = f
        rec[r, REC_MAX] = v0
        rec[r, REC_MAX + 1] = v1
        rec[r, REC_MAX + 2] = v2
        rec[r, REC_MAX + 3] = v3
        rec[r, REC_MAX + 4] = v4
        _count(a, rec, r)
        state[r] = ROW_COUNTED
    a[A_NDIRTY] = 0


@jit
def _mark_dirty(a, state, r):
    # row r was written: (re)counted before the next answers
    if state[r] & ROW_DIRTY:
        return
    R = a[A_R]
    dirty = view_i32(a[A_DIRTY], R)
    n = a[A_NDIRTY]
    if n == R:  # (full: rows freed and added again since the last answers)
        n = _compact_dirty(dirty, n, state)
    dirty[n] = r
    a[A_NDIRTY] = n + 1
    state[r] |= ROW_DIRTY


@jit
def _compact_dirty(dirty, n, state):
    # the list without its rows freed since and its repeats: fewer than R
    # when a row that is not dirty is to be added
    m = 0
    for i in range(n):
        r = dirty[i]
        if state[r] & ROW_DIRTY and not state[r] & ROW_LISTED:
            state[r] |= ROW_LISTED
            dirty[m] = r
            m += 1
    for i in range(m):
        state[dirty[i]] ^= ROW_LISTED  # (set just above)
    return m


@jit
def sp_rows_changed(a_addr, table_ctx_addr):
    """After a table step (its context at ``table_ctx_addr``): its freed
    rows leave the counts, its new rows are dirty."""
    a = view_i64(a_addr, A_SIZE)
    if not a[A_VALID]:
        return
    R = a[A_R]
    tc = view_i64(table_ctx_addr, T.TB_SIZE)
    res = view_i32(tc[T.TB_RES], 3 * R)
    state = view_u8(a[A_ROW], R)
    rec = view_i32(a[A_REC], R * REC_COLS).reshape((R, REC_COLS))
    for i in range(tc[T.TB_RES_NF]):
        r = res[2 * R + i]
        if state[r] & ROW_COUNTED:
            _uncount(a, rec, r)
        state[r] = 0
    nc = tc[T.TB_RES_NC]
    for i in range(tc[T.TB_RES_NN]):
        _mark_dirty(a, state, res[nc + i])


@jit
def sp_row_written(a_addr, r):
    """Row ``r`` (in [0, R); any other value: every batch by a pass from
    now on) was written outside a table step."""
    a = view_i64(a_addr, A_SIZE)
    R = a[A_R]
    if r < 0 or r >= R:
        a[A_VALID] = 0
        return
    _mark_dirty(a, view_u8(a[A_ROW], R), r)


@jit
def sp_answers(a_addr, idx_addr, n):
    """The answers for the ``n`` rows at ``idx_addr`` (intp, each in
    [0, R), distinct, live): ``(flags, max num_logprobs, max num_token_ids
    (0 for none), max top_k, max top_k over rows with top_p < 1 (-1: none),
    max num_bad_words)``. From the counts when the batch is every live row
    (as many rows as counted); else by a pass over the batch."""
    a = view_i64(a_addr, A_SIZE)
    R, vocab = a[A_R], a[A_VOCAB]
    arrs = _arrays(a, R)
    state = view_u8(a[A_ROW], R)
    rec = view_i32(a[A_REC], R * REC_COLS).reshape((R, REC_COLS))
    if a[A_NDIRTY]:
        _count_dirty(a, arrs, rec, state, vocab)
    if not (a[A_VALID] and n == a[A_COUNT]):
        return _batch_pass(arrs, view_i64(idx_addr, n), n, vocab)
    if a[A_STALE]:
        _recount_maxima(a, rec, state, R)
    flags = 0
    for j in range(N_FLAGS):
        if a[A_BITS + j] > 0:
            flags |= 1 << j
    a[A_FAST] += 1
    m = A_MAXV
    return flags, a[m], a[m + 1], a[m + 2], a[m + 3], a[m + 4]
