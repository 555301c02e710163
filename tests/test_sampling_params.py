"""New requests' sampling params read in place and written by address
(``_kernels.sampling_params``) against a reference written as vLLM 0.34's
``Sampler.add_request`` writes a request without a logit bias, allowed
token ids, min_tokens, bad words or logprob token ids; its seeds against
``np.random.randint(INT64_MIN, INT64_MAX)`` drawn in the same order; and
the checks that refuse bad params before anything is written."""

from __future__ import annotations

import ctypes
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpstate._kernels import sampling_params as P

VOCAB = 64
R = 16
I64_MIN, I64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
DTYPES = {
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "min_p": np.float32,
    "seeds_set": np.bool_,
    "seeds": np.int64,
    "num_logprobs": np.int32,
    "needs_logits_processing": np.bool_,
    "may_mask_logits": np.bool_,
    "repetition_penalty": np.float32,
    "frequency_penalty": np.float32,
    "presence_penalty": np.float32,
    "use_penalty": np.bool_,
    "num_allowed_token_ids": np.int32,
    "num_logit_bias": np.int32,
    "min_lens": np.int32,
    "num_stop_token_ids": np.int32,
    "restore_when_all_masked": np.int32,
    "use_logit_bias": np.bool_,
    "num_bad_words": np.int32,
    "num_token_ids": np.int32,
    "prompt_len": np.int32,
}
NAMES = tuple(sys.intern(n) for n in P.SP_NAMES)


def params(**kw):
    base = dict(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=None,
        logprobs=None,
        repetition_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        allowed_token_ids=None,
        logit_bias=None,
        min_tokens=0,
        bad_words_token_ids=None,
        logprob_token_ids=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def targets():
    t = {name: np.full(R, 7, DTYPES[name]) for name in P.SP_TARGETS}  # (7: a stale value)
    t["prompt_len"][:] = np.arange(R) * 3 + 1
    return t


class Stash:
    """The stash and context ``SamplingParamsWriter`` keeps, over ``t``'s arrays."""

    def __init__(self, t=None):
        self.t = targets() if t is None else t
        self.f = np.zeros((R, P.F_COLS))
        self.i = np.zeros((R, P.I_COLS), np.int64)
        self.sp = np.zeros(R, np.int64)
        self.pen = np.zeros(R, np.int64)
        ctx = np.zeros(P.C_SIZE, np.int64)
        ctx[: P.N_NAMES] = [id(n) for n in NAMES]
        ctx[P.C_FLOAT : P.C_DICT + 1] = [id(float), id(int), id(None), id(bool), id(list), id(dict)]
        ctx[P.C_F], ctx[P.C_I], ctx[P.C_SP] = self.f.ctypes.data, self.i.ctypes.data, self.sp.ctypes.data
        ctx[P.C_TARGETS : P.C_TARGETS + P.N_TARGETS] = [self.t[n].ctypes.data for n in P.SP_TARGETS]
        ctx[P.C_PEN], ctx[P.C_R], ctx[P.C_VOCAB] = self.pen.ctypes.data, R, VOCAB
        self.ctx = ctx
        self.n = 0

    def read(self, reqs):
        self.reqs, self.n = reqs, len(reqs)
        return P.sp_read(id(reqs), len(reqs), self.ctx.ctypes.data)

    def write(self, rows, start=0, cursor=0, fn=None, state=None):
        rows = [int(r) for r in rows]
        sps = [r.sampling_params for r in self.reqs if r.sampling_params is not None][: len(rows)]
        bg = np.random.mtrand._rand._bit_generator
        c = bg.ctypes
        if fn is None:
            fn, state = ctypes.cast(c.next_uint64, ctypes.c_void_p).value, c.state_address
        with bg.lock:
            nxt, n_pen, cursor = P.sp_write(id(rows), id(sps), len(rows), start, cursor, self.n, self.ctx.ctypes.data,
                                            fn, state)  # fmt: skip
        return nxt, self.pen[:n_pen].tolist(), cursor


def vllm_add(t, row, sp):
    """vLLM 0.34's Sampler.add_request for such a request, on the arrays."""
    t["temperature"][row] = sp.temperature
    t["top_p"][row] = sp.top_p
    k = sp.top_k if 0 < sp.top_k <= VOCAB else VOCAB
    t["top_k"][row] = k
    t["min_p"][row] = sp.min_p
    t["seeds_set"][row] = sp.seed is not None
    t["seeds"][row] = sp.seed if sp.seed is not None else np.random.randint(I64_MIN, I64_MAX)
    t["num_logprobs"][row] = -1 if sp.logprobs is None else (VOCAB if sp.logprobs == -1 else sp.logprobs)
    temp = sp.temperature
    needs = temp != 0.0 and (temp != 1.0 or sp.min_p != 0.0 or k != VOCAB or sp.top_p != 1.0)
    may_mask = t["temperature"][row] != 0.0 and (
        t["min_p"][row] != 0.0 or t["top_k"][row] != VOCAB or t["top_p"][row] != 1.0
    )
    t["repetition_penalty"][row] = sp.repetition_penalty
    t["frequency_penalty"][row] = sp.frequency_penalty
    t["presence_penalty"][row] = sp.presence_penalty
    pen = sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
    t["use_penalty"][row] = pen
    t["num_allowed_token_ids"][row] = 0
    t["num_logit_bias"][row] = 0
    t["min_lens"][row] = t["prompt_len"][row] + sp.min_tokens
    t["num_stop_token_ids"][row] = 0
    t["restore_when_all_masked"][row] = 0
    t["use_logit_bias"][row] = False
    t["num_bad_words"][row] = 0
    t["num_token_ids"][row] = 0
    may_mask = bool(may_mask) or pen
    t["needs_logits_processing"][row] = needs or may_mask
    t["may_mask_logits"][row] = may_mask
    return pen


FLOATS = st.sampled_from([0.0, 1.0, 0.7, 0.9, 1e-9, 1.0000000001, 2.5, 0.1]) | st.floats(0, 3, width=64)
PARAMS = st.builds(
    params,
    temperature=FLOATS | st.integers(0, 2),
    top_k=st.sampled_from([-1, 0, 1, 50, VOCAB - 1, VOCAB, VOCAB + 1, 10**9]),
    top_p=FLOATS,
    min_p=FLOATS,
    seed=st.none() | st.integers(I64_MIN, I64_MAX),
    logprobs=st.none() | st.integers(-1, 20),
    repetition_penalty=FLOATS,
    frequency_penalty=st.sampled_from([0.0, 0.2, -0.5]),
    presence_penalty=st.sampled_from([0.0, 0.3]),
    allowed_token_ids=st.sampled_from([None, []]),
    logit_bias=st.sampled_from([None, {}]),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(PARAMS, min_size=1, max_size=R), st.integers(0, 2**32 - 1), st.randoms())
def test_writes_equal_vllms_add_request(sps, seed, rnd):
    reqs = [SimpleNamespace(req_id=f"r{i}", sampling_params=sp) for i, sp in enumerate(sps)]
    rows = rnd.sample(range(R), len(sps))
    want, got = targets(), targets()
    np.random.seed(seed)
    want_pen = [r for r, sp in zip(rows, sps) if vllm_add(want, r, sp)]
    s = Stash(got)
    assert s.read(reqs) == (P.SPR_OK, 0, 0)
    np.random.seed(seed)
    nxt, pen, _ = s.write(rows)
    assert nxt == len(rows) and pen == want_pen
    for name in P.SP_TARGETS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the same generator state after: the draws were numpy's own
    after = np.random.randint(I64_MIN, I64_MAX)
    np.random.seed(seed)
    for sp in sps:
        if sp.seed is None:
            np.random.randint(I64_MIN, I64_MAX)
    assert np.random.randint(I64_MIN, I64_MAX) == after


@pytest.mark.parametrize(
    "field, value",
    [
        ("allowed_token_ids", [3]),
        ("allowed_token_ids", (3,)),
        ("logit_bias", {3: 1.0}),
        ("min_tokens", 2),
        ("bad_words_token_ids", [[1, 2]]),
        ("logprob_token_ids", [5]),
    ],
)
def test_what_vllms_own_add_request_must_write(field, value):
    # such a request is left to vLLM's add_request, in its place in the order
    reqs = [SimpleNamespace(req_id=f"r{i}", sampling_params=params()) for i in range(3)]
    setattr(reqs[1].sampling_params, field, value)
    s = Stash()
    t = s.t
    assert s.read(reqs) == (P.SPR_OK, 0, 0)
    assert s.i[:3, P.I_KIND].tolist() == [P.SP_PLAIN, P.SP_SPECIAL, P.SP_PLAIN]
    assert s.write([4, 5, 6]) == (1, [], 2)  # stops at the special one (its place taken)
    assert t["temperature"][5] == 7 and t["temperature"][4] == 1.0
    assert s.write([4, 5, 6], start=2, cursor=2) == (3, [], 3)
    assert t["temperature"][6] == 1.0 and t["temperature"][5] == 7


def test_params_other_than_the_ones_read_go_to_vllm():
    reqs = [SimpleNamespace(req_id=f"r{i}", sampling_params=params()) for i in range(2)]
    s = Stash()
    assert s.read(reqs) == (P.SPR_OK, 0, 0)
    reqs[0].sampling_params = params(temperature=0.5)  # (another object than the one read)
    assert s.write([3, 4]) == (0, [], 0)
    assert s.t["temperature"][3] == 7


def test_pooling_requests_are_skipped():
    s = Stash()
    reqs = [SimpleNamespace(req_id="p", sampling_params=None)]
    assert s.read(reqs) == (P.SPR_OK, 0, 0) and s.i[0, P.I_KIND] == P.SP_NONE


class _Raises:
    def __getattr__(self, name):
        raise RuntimeError("boom")


@pytest.mark.parametrize(
    "change, status, field",
    [
        ({"temperature": float("nan")}, P.SPR_NOT_FINITE, "temperature"),
        ({"temperature": float("inf")}, P.SPR_NOT_FINITE, "temperature"),
        ({"temperature": "0.7"}, P.SPR_TYPE, "temperature"),
        ({"temperature": None}, P.SPR_TYPE, "temperature"),
        ({"top_k": 1.5}, P.SPR_TYPE, "top_k"),
        ({"top_k": 2**70}, P.SPR_RANGE, "top_k"),
        ({"seed": 2**63}, P.SPR_RANGE, "seed"),
        ({"seed": -(2**63) - 1}, P.SPR_RANGE, "seed"),
        ({"seed": "7"}, P.SPR_TYPE, "seed"),
        ({"logprobs": -2}, P.SPR_RANGE, "logprobs"),
        ({"logprobs": 2**31}, P.SPR_RANGE, "logprobs"),
        ({"top_p": [1.0]}, P.SPR_TYPE, "top_p"),
        ({"repetition_penalty": True}, P.SPR_TYPE, "repetition_penalty"),
        ({"min_tokens": "1"}, P.SPR_TYPE, "min_tokens"),
    ],
)
def test_bad_params_are_reported_with_request_and_field(change, status, field):
    reqs = [SimpleNamespace(req_id=f"r{i}", sampling_params=params()) for i in range(3)]
    for k, v in change.items():
        setattr(reqs[2].sampling_params, k, v)
    assert Stash().read(reqs) == (status, 2, P.SP_NAMES.index(field))


def test_unreadable_params_are_reported():
    reqs = [SimpleNamespace(req_id="a", sampling_params=params()), SimpleNamespace(req_id="b")]
    assert Stash().read(reqs) == (P.SPR_MISSING, 1, 0)
    sp = params()
    del sp.min_p
    assert Stash().read([SimpleNamespace(req_id="c", sampling_params=sp)]) == (P.SPR_MISSING, 0, 4)
    assert Stash().read([SimpleNamespace(req_id="d", sampling_params=_Raises())]) == (P.SPR_MISSING, 0, 1)
    # (the exception was taken: nothing pending)
    assert sys.exc_info() == (None, None, None)


def test_seed_draw_matches_numpy_at_its_edges():
    # the draw is INT64_MIN + next_uint64, 2**64 - 1 rejected (numpy's masked
    # rejection): the conversion at 0, 2**63 - 1, 2**63, 2**64 - 2
    vals = iter([0, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1, 5])
    fn = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)(lambda _: next(vals))
    s = Stash()
    reqs = [SimpleNamespace(req_id=f"r{i}", sampling_params=params()) for i in range(5)]
    assert s.read(reqs) == (P.SPR_OK, 0, 0)
    fp = ctypes.cast(fn, ctypes.c_void_p).value
    assert s.write(range(5), fn=fp, state=0) == (5, [], 5)
    assert s.t["seeds"][:5].tolist() == [I64_MIN, -1, 0, 2**63 - 2, I64_MIN + 5]


def _upload_ctx(srcs, slots, R, D):
    T = len(srcs)
    o_src, o_size, o_slots, o_count, o_full, o_rows, total = P._layout(T, D)
    rows = np.zeros((D, R), np.int64)
    ctx = np.zeros(total, np.int64)
    ctx[P.U_T], ctx[P.U_D], ctx[P.U_R], ctx[P.U_INT] = T, D, R, id(int)
    ctx[o_src : o_src + T] = [a.ctypes.data for a in srcs]
    ctx[o_size : o_size + T] = [a.itemsize for a in srcs]
    ctx[o_slots : o_slots + T * D] = [b.ctypes.data for s in slots for b in s]
    ctx[o_rows : o_rows + D] = [rows[b].ctypes.data for b in range(D)]
    return ctx, rows


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, R - 1), max_size=R + 3), max_size=12), st.sampled_from([2, 3]))
def test_uploads_fill_each_slot_with_what_changed_since_it_was_filled(steps, D):
    # the model: vLLM's pool copies the whole array into its next slot each
    # time; here only rows written since that slot was last filled, and no
    # rotation when nothing was written; either way the current slot equals
    # the array and a slot in use by an earlier upload is left alone
    srcs = [np.zeros(R, np.float32), np.zeros(R, np.int64), np.zeros(R, np.int32)]
    slots = [[np.zeros(R, a.dtype) for _ in range(D)] for a in srcs]
    ctx, _ = _upload_ctx(srcs, slots, R, D)
    curr, history = 0, [0]
    for k, rows in enumerate(steps):
        for a in srcs:
            a[rows] = k + 1
        P.sp_mark(ctx.ctypes.data, id(rows), len(rows))
        if rows:
            before = [[b.copy() for b in s] for s in slots]
            b = P.sp_upload(ctx.ctypes.data)
            assert b == (curr + 1) % D
            for t, a in enumerate(srcs):
                np.testing.assert_array_equal(slots[t][b], a)
                for c in range(D):  # (the other slots untouched)
                    if c != b:
                        np.testing.assert_array_equal(slots[t][c], before[t][c])
            curr = b
        else:
            assert ctx[P.U_PENDING] == 0  # (nothing written: nothing to upload)
        history.append(curr)


class _Slotted:
    # fields as slots, as a msgspec Struct holds them (read in place)
    __slots__ = tuple(P.SP_NAMES[1:])

    def __init__(self, **kw):
        for k, v in vars(params(**kw)).items():
            setattr(self, k, v)


@settings(max_examples=60, deadline=None)
@given(st.lists(PARAMS, min_size=1, max_size=R))
def test_fields_read_in_place_from_slots_equal_getattr(sps):
    from mtpstate.integrations.vllm.sampler.params_writer import _slot_offset

    slotted = [_Slotted(**vars(sp)) for sp in sps]
    offs = [-1] + [_slot_offset(_Slotted, slotted[0], n) for n in P.SP_NAMES[1:]]
    assert min(offs[1:]) >= 16  # (every field found as a slot)
    a, b = Stash(), Stash()
    b.ctx[P.C_FAST] = id(_Slotted)
    b.ctx[P.C_OFFS : P.C_OFFS + P.N_NAMES] = offs
    ra = [SimpleNamespace(req_id=f"r{i}", sampling_params=sp) for i, sp in enumerate(sps)]
    rb = [SimpleNamespace(req_id=f"r{i}", sampling_params=sp) for i, sp in enumerate(slotted)]
    assert a.read(ra) == b.read(rb) == (P.SPR_OK, 0, 0)
    n = len(sps)
    np.testing.assert_array_equal(a.f[:n], b.f[:n])
    np.testing.assert_array_equal(a.i[:n], b.i[:n])
    # an unset slot is an attribute that cannot be read
    del slotted[-1].min_p
    assert b.read(rb) == (P.SPR_MISSING, n - 1, P.SP_NAMES.index("min_p"))


def test_a_row_that_is_not_an_int_marks_every_row():
    srcs = [np.arange(R, dtype=np.int32)]
    slots = [[np.zeros(R, np.int32) for _ in range(2)]]
    ctx, _ = _upload_ctx(srcs, slots, R, 2)
    rows = [np.int64(3)]  # (not an exact int: its row is not read)
    P.sp_mark(ctx.ctypes.data, id(rows), 1)
    assert P.sp_upload(ctx.ctypes.data) == 1
    np.testing.assert_array_equal(slots[0][1], srcs[0])  # (the whole array)
