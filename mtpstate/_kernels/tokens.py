"""New requests' token ids on their way to the device.

A step's token ids are the one part of what it stages that the table's
shape does not bound (new requests x max_model_len), so they are staged
apart from the other elements: pass 2 of add records one *run* per new
request (``TR_*``: where its tokens go, where they are read from, how many)
and stages what fits of it in the open slot's token area (shipped by the
step's one replay). The mirror ships any rest in chunks through its own
ring, filled by ``tok_fill`` from the same runs while ``apply`` still holds
the requests' token objects.
"""

from __future__ import annotations

from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import ld32, ld64, st32, st64, view_i64
from mtpstate._kernels.pyobjects import _pytypes, _vget
from mtpstate._kernels.slots import (
    IX_SIZE,
    STG_META,
    TB_STG_CAP,
    TB_STG_POS,
    TB_STG_VAL,
    TB_TOK_CAP,
    TB_TOK_RUNS,
    TR_DST,
    TR_KIND,
    TR_N,
    TR_SRC,
    TR_STRIDE,
)
from mtpstate._kernels.status import V_I32


@jit(signature="void(int64, int64, UniTuple(int64, 10), int64, int64, int64, int64, int64, int64)")
def _stage_tokens(kind, src, tp, t0, count, dst, a_pos, a_val, at):
    """Tokens ``t0 .. t0 + count`` of a run (source vector ``kind``/``src``,
    validated in pass 1) staged at ``at``: positions ``dst + t``, values."""
    if kind == V_I32:  # int32 tokens (vLLM's TokenBuffer, the table's host row): a plain copy
        for t in range(count):
            st64(a_pos, at + t, dst + t0 + t)
            st32(a_val, at + t, ld32(src, t0 + t))
        return
    for t in range(count):
        v, st = _vget(kind, src, t0 + t, tp)
        st64(a_pos, at + t, dst + t0 + t)
        st32(a_val, at + t, v)


@jit
def stage_token_run(tb, tp, k, dst, kind, src, n, nt):
    """New request k's run recorded, and what fits of it staged in the slot's
    token area after the step's first ``nt`` tokens. Returns the step's
    token count with this run's."""
    a_runs = tb[TB_TOK_RUNS] + 8 * k * TR_STRIDE
    st64(a_runs, TR_DST, dst)
    st64(a_runs, TR_KIND, kind)
    st64(a_runs, TR_SRC, src)
    st64(a_runs, TR_N, n)
    fit = min(n, max(0, tb[TB_TOK_CAP] - nt))
    cap = tb[TB_STG_CAP]  # (the token area follows the slot's elements)
    _stage_tokens(kind, src, tp, 0, fit, dst, tb[TB_STG_POS] + 8 * (cap + STG_META), tb[TB_STG_VAL] + 4 * cap, nt)
    return nt + n


@jit
def tok_fill(ixc, a_runs, nruns, skip, cap, a_pos, a_val):
    """Stage up to ``cap`` of the step's tokens, after its first ``skip``,
    from its ``nruns`` runs at ``a_runs``, into a chunk (``a_pos`` int64,
    ``a_val`` int32). Returns how many were staged."""
    tp = _pytypes(view_i64(ixc, IX_SIZE))
    n = 0
    for k in range(nruns):
        o = k * TR_STRIDE
        m = ld64(a_runs, o + TR_N)
        if skip >= m:
            skip -= m
            continue
        take = min(m - skip, cap - n)
        _stage_tokens(
            ld64(a_runs, o + TR_KIND),
            ld64(a_runs, o + TR_SRC),
            tp,
            skip,
            take,
            ld64(a_runs, o + TR_DST),
            a_pos,
            a_val,
            n,
        )
        n += take
        skip = 0
        if n == cap:
            break
    return n
