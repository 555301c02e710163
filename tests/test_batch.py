"""StepResult.batch against vLLM 0.34's gather_batch_req_state, written as a
loop (mtpstate.tools.reference.vllm_gather_batch), field by field, every step;
and its bad inputs: a StateError naming the request and field, state unchanged."""

import pickle
import sys
from collections import OrderedDict

import numpy as np
import pytest
from helpers import SIM_KNOBS, assert_same_snapshot, table_snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

import mtpstate
from mtpstate import InvalidStepError, UnknownRequestError
from mtpstate.tools.reference import VllmLoopRequestTable
from mtpstate.tools.sim import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, Simulator
from mtpstate.tools.workloads import vllm_busy, vllm_shaped, vllm_steady_decode

ARRAYS = (
    "num_scheduled_tokens",
    "num_draft_tokens_np",
    "prefill_len_np",
    "num_computed_prefill_tokens_np",
    "is_prefilling_np",
    "max_seq_len_np",
    "prefill_runs_as_decode_np",
)
SCALARS = ("num_tokens", "has_prefill", "decode_graph_eligible", "max_query_len")
INPUT_ARRAYS = ("query_start_loc_np", "cu_num_logits_np", "seq_lens_cpu_upper_bound_np", "num_computed_tokens_np")
EXPANDED = ("expanded_idx_mapping_np", "expanded_local_pos_np")  # rows / positions, None where left to vLLM
INPUT_SCALARS = ("num_logits", "num_draft_tokens", "logits_fit")


def assert_batch_agrees(table, loop, got, want):
    assert got is not None
    assert got.req_ids == want["req_ids"]
    for f in ARRAYS:
        a, b = getattr(got, f), want[f]
        if b is None:
            assert a is None, f
        else:
            assert a is not None, f
            assert a.dtype == b.dtype, f
            np.testing.assert_array_equal(a, b, err_msg=f)
    for f in SCALARS:
        assert getattr(got, f) == want[f], f
    # prepare_inputs' host arrays (vLLM's numpy, mtpstate.tools.reference.vllm_prepare_inputs_host)
    for f in INPUT_ARRAYS:
        a, b = getattr(got, f), want[f]
        assert a.dtype == b.dtype, f
        np.testing.assert_array_equal(a, b, err_msg=f)
    for f in INPUT_SCALARS:
        assert getattr(got, f) == want[f], f
    # idx_mapping through each side's own rows
    assert got.idx_mapping_np.dtype == np.intp
    inv = {row: r for r, row in loop.req_id_to_index.items()}
    assert [table.index.req_id(int(r)) for r in got.idx_mapping_np] == want["req_ids"]
    assert [inv[int(r)] for r in want["idx_mapping_np"]] == want["req_ids"]
    # vLLM's expand_idx_mapping: the expanded rows through each side's own rows too
    gi, gp = (getattr(got, f) for f in EXPANDED)
    wi, wp = (want[f] for f in EXPANDED)
    assert (gi is None, gp is None) == (wi is None, wi is None), (gi, wi)
    if wi is not None:
        assert gi.dtype == wi.dtype == np.int64 and gp.dtype == wp.dtype == np.int32
        assert [table.index.req_id(int(r)) for r in gi] == [inv[int(r)] for r in wi]
        np.testing.assert_array_equal(gp, wp)


def drive(steps, n, dql, fresh=False, warm=(), bonus=1):
    kw = dict(max_num_reqs=n, max_model_len=16384, block_sizes=[16])
    t = mtpstate.RequestTable(**kw, decode_query_len=dql, sampled_tokens_per_step=bonus)
    loop = VllmLoopRequestTable(**kw, decode_query_len=dql, sampled_tokens_per_step=bonus)
    for so in list(warm) + list(steps):
        if fresh:
            so = pickle.loads(pickle.dumps(so))
        res = t.apply(so)
        want = loop.apply(so)
        assert_batch_agrees(t, loop, res.batch, want)
    return t


@pytest.mark.parametrize("fresh", [False, True])
def test_busy_vllm_shaped_steps(fresh):
    warm, timed = vllm_busy(64, steps=40, seed=3)
    drive(timed, 64, dql=4, fresh=fresh, warm=warm)


@pytest.mark.parametrize("bonus", [2, 5])
def test_inputs_with_more_sampled_tokens_per_step(bonus):
    """cu_num_logits counts drafts + every sampled token; with 5 a step's
    requests are not all scheduled their logits' tokens (logits_fit False)."""
    warm, timed = vllm_busy(32, steps=30, seed=4)
    t = drive(timed, 32, dql=4, warm=warm, bonus=bonus)
    assert t.sampled_tokens_per_step == bonus


def test_sampled_tokens_per_step_must_be_positive():
    with pytest.raises(ValueError, match="sampled_tokens_per_step"):
        mtpstate.RequestTable(max_num_reqs=4, max_model_len=64, decode_query_len=2, sampled_tokens_per_step=0)


@pytest.mark.parametrize("fresh", [False, True])
def test_steady_decode_steps(fresh):
    setup, timed = vllm_steady_decode(48, steps=12, fresh_ids=fresh)
    drive(timed, 48, dql=4, warm=setup)


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 40),
    dql=st.integers(1, 5),
    num_spec=SIM_KNOBS["num_spec"],
    accept=SIM_KNOBS["accept"],
    preempt_prob=SIM_KNOBS["preempt_prob"],
    abort_prob=SIM_KNOBS["abort_prob"],
    prefix_hit_prob=SIM_KNOBS["prefix_hit_prob"],
    seed=SIM_KNOBS["seed"],
)
def test_simulated_traces(n, dql, num_spec, accept, preempt_prob, abort_prob, prefix_hit_prob, seed):
    sim = Simulator(
        max_num_reqs=n,
        max_model_len=16384,
        num_spec=num_spec,
        accept=accept,
        preempt_prob=preempt_prob,
        abort_prob=abort_prob,
        prefix_hit_prob=prefix_hit_prob,
        resume_mode="new",
        seed=seed,
    )
    drive([vllm_shaped(so) for so in sim.run(30)], n, dql)


def _table_with(ids, dql=4, prefill=8, computed=None):
    t = mtpstate.RequestTable(max_num_reqs=16, max_model_len=256, block_sizes=[16], decode_query_len=dql)
    new = [
        NewRequestData(r, list(range(prefill)), SamplingParams(16), ([k],), prefill if computed is None else computed)
        for k, r in enumerate(ids)
    ]
    t.apply(SchedulerOutput(scheduled_new_reqs=new))
    return t


def _decode_step(ids, nst, spec=None, total=None):
    cached = CachedRequestData(req_ids=list(ids), num_computed_tokens=[8] * len(ids), new_block_ids=[None] * len(ids))
    so = SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens=nst)
    so.scheduled_spec_decode_tokens = spec if spec is not None else {}
    if total is None and isinstance(nst, dict):
        total = sum(v for v in nst.values() if type(v) is int)
    so.total_num_scheduled_tokens = total
    return so


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(1, 6), min_size=0, max_size=12),
    drafts=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    dql=st.integers(1, 4),
    shuffle=st.randoms(),
)
def test_sort_order_is_vllms(counts, drafts, dql, shuffle):
    """Any mix of decode/extend/prefill counts and draft lists, in any dict
    order: the exact order of sort_batch_req_ids (ties in dict order)."""
    ids = [f"req-{i}" for i in range(12)]
    t = _table_with(ids, dql=dql)
    loop = VllmLoopRequestTable(max_num_reqs=16, max_model_len=256, block_sizes=[16], decode_query_len=dql)
    loop.apply(SchedulerOutput(scheduled_new_reqs=[NewRequestData(r, list(range(8)), SamplingParams(16), ([k],), 8)
                                                   for k, r in enumerate(ids)]))  # fmt: skip
    sched = ids[: len(counts)]
    shuffle.shuffle(sched)
    nst = {r: c for r, c in zip(sched, counts)}
    spec = {r: [7] * d for r, d in zip(sched, drafts) if d or shuffle.random() < 0.3}
    so = _decode_step(ids, nst, spec)
    res = t.apply(so)
    assert_batch_agrees(t, loop, res.batch, loop.apply(so))


def test_no_batch_without_decode_query_len_or_counts():
    t = mtpstate.RequestTable(max_num_reqs=4, max_model_len=64)
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2], SamplingParams(4), ([0],), 0)], num_scheduled_tokens={"a": 2}
    )
    assert t.apply(so).batch is None
    t2 = _table_with(["a"])
    so = _decode_step(["a"], {"a": 1})
    so.num_scheduled_tokens = None
    assert t2.apply(so).batch is None


def test_mapping_types_and_empty_batch():
    t = _table_with(["a", "b"])
    res = t.apply(_decode_step(["a", "b"], OrderedDict([("b", 4), ("a", 1)]), spec={"b": [1, 2, 3]}))
    assert res.batch.req_ids == ["b", "a"]
    assert res.batch.num_draft_tokens_np.tolist() == [3, 0]
    res = t.apply(_decode_step([], {}))
    assert res.batch.req_ids == [] and res.batch.max_query_len == 0 and res.batch.num_tokens == 0
    assert res.batch.num_draft_tokens_np is None


class _Mutator:
    """total_num_scheduled_tokens whose __index__ changes the step's dict
    (Python code that runs while the step is bound)."""

    def __init__(self, d, add):
        self.d = d
        self.add = add

    def __index__(self):
        self.d.pop(next(iter(self.d)))
        self.d[self.add] = 1
        return sum(self.d.values())


BAD = {
    "not live": (lambda: {"a": 1, "zz": 1}, None, None, UnknownRequestError, "'zz'"),
    "count str": (lambda: {"a": "1", "b": 1}, None, None, InvalidStepError, "num_scheduled_tokens"),
    "count bool": (lambda: {"a": True, "b": 1}, None, None, InvalidStepError, "'a'"),
    "count negative": (lambda: {"a": -1, "b": 1}, None, None, InvalidStepError, "'a'"),
    "count huge": (lambda: {"a": 2**70, "b": 1}, None, None, InvalidStepError, "num_scheduled_tokens"),
    "count float": (lambda: {"a": 1.0, "b": 1}, None, None, InvalidStepError, "'a'"),
    "not a dict": (lambda: [("a", 1)], None, None, InvalidStepError, "num_scheduled_tokens must be a dict"),
    "total differs": (lambda: {"a": 1, "b": 1}, None, 5, InvalidStepError, "total_num_scheduled_tokens"),
    "drafts None": (lambda: {"a": 1, "b": 1}, {"a": None}, None, InvalidStepError, "'a'"),
    "drafts int": (lambda: {"a": 1, "b": 1}, {"b": 3}, None, InvalidStepError, "scheduled_spec_decode_tokens"),
    "id not str": (lambda: {"a": 1, 7: 1}, None, None, mtpstate.StateError, "scheduled request id"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_batch_input_changes_nothing(case):
    make_nst, spec, total, exc, text = BAD[case]
    t = _table_with(["a", "b"], computed=3)
    before = table_snapshot(t)
    so = _decode_step(["a", "b"], make_nst(), spec, total)
    if total is not None:
        so.total_num_scheduled_tokens = total
    with pytest.raises(exc, match=text.replace("(", r"\(").replace("*", r"\*")):
        t.apply(so)
    assert_same_snapshot(before, table_snapshot(t))
    assert t.apply(_decode_step(["a", "b"], {"a": 1, "b": 1})).batch.req_ids == ["a", "b"]


def test_dict_changed_while_binding():
    """The dicts are read once, by the kernel, under the GIL: a change made
    by a callback while the step is bound is seen whole (here: the first id
    replaced by another one, live or not)."""
    t = _table_with(["a", "b", "c"])
    nst = {"a": 1, "b": 2}
    so = _decode_step(["a", "b"], nst)
    so.total_num_scheduled_tokens = _Mutator(nst, "c")
    assert t.apply(so).batch.req_ids == ["c", "b"]
    before = table_snapshot(t)
    nst = {"a": 1, "b": 2}
    so = _decode_step(["a", "b"], nst)
    so.total_num_scheduled_tokens = _Mutator(nst, "zz")
    with pytest.raises(UnknownRequestError, match="'zz'"):
        t.apply(so)
    assert_same_snapshot(before, table_snapshot(t))


def test_bad_batch_in_a_general_step_changes_nothing():
    """A step that also adds and finishes requests (the two-pass kernel)."""
    t = _table_with(["a", "b"])
    before = table_snapshot(t)
    so = _decode_step(["a"], {"a": 1, "c": 2, "zz": 1})
    so.finished_req_ids = {"b"}
    so.scheduled_new_reqs = [NewRequestData("c", [1, 2], SamplingParams(4), ([5],), 0)]
    with pytest.raises(UnknownRequestError, match="'zz'"):
        t.apply(so)
    assert_same_snapshot(before, table_snapshot(t))
    so.num_scheduled_tokens = {"a": 1, "c": 2}
    so.total_num_scheduled_tokens = 3
    assert t.apply(so).batch.req_ids == ["a", "c"]
    # an id finished by the step cannot be scheduled
    so = _decode_step(["a"], {"a": 1, "c": 2})
    so.finished_req_ids = {"c"}
    with pytest.raises(UnknownRequestError, match="'c'"):
        t.apply(so)


def test_split_table_dict_falls_back_to_pydict_next():
    """An instance's __dict__ (a split table on CPython >= 3.11: its values
    are not in the entries) is read with PyDict_Next, with the same result."""
    import ctypes

    class Holder:
        pass

    h = Holder()
    h.b = 4  # attribute names double as request ids
    h.a = 1
    nst = vars(h)
    split = ctypes.c_int64.from_address(id(nst) + 40).value != 0
    t = _table_with(["a", "b"])
    res = t.apply(_decode_step(["a", "b"], nst, spec={"b": [1, 2, 3]}))
    assert res.batch.req_ids == ["b", "a"] and res.batch.num_scheduled_tokens.tolist() == [4, 1]
    assert split or sys.version_info < (3, 11)  # the case this test is about


@pytest.mark.parametrize("cap", [0, 7, 64])
def test_expanded_logits_within_capacity_only(cap):
    """expand_idx_mapping's outputs are computed for a step whose logits fit
    max_num_logits and whose requests each have at most decode_query_len
    (vLLM's kernel writes no more); other steps have them None (left to
    vLLM's kernel), and both kinds occur here."""
    warm, timed = vllm_busy(32, steps=30, seed=5)
    kw = dict(max_num_reqs=32, max_model_len=16384, block_sizes=[16], decode_query_len=4)
    t = mtpstate.RequestTable(**kw, max_num_logits=cap)
    loop = VllmLoopRequestTable(**kw, max_num_logits=cap)
    seen = set()
    for so in list(warm) + list(timed):
        b = t.apply(so).batch
        assert_batch_agrees(t, loop, b, loop.apply(so))
        seen.add(b.expanded_idx_mapping_np is None)
    assert seen == ({True} if cap == 0 else {True, False}), seen


def test_max_num_logits_must_not_be_negative():
    with pytest.raises(ValueError, match="max_num_logits"):
        mtpstate.RequestTable(max_num_reqs=4, max_model_len=64, decode_query_len=2, max_num_logits=-1)
