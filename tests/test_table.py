"""RequestTable against the loop oracle, on simulated multi-step traces; bad
input; rows across PYTHONHASHSEED values."""

import pickle
import subprocess
import sys

import numpy as np
import pytest
from helpers import SIM_KNOBS, assert_same_snapshot, assert_tables_agree, genericize, run_differential, table_snapshot
from hypothesis import given
from hypothesis import strategies as st

from mtpstate import (
    CapacityError,
    DuplicateRequestError,
    InvalidStepError,
    RequestTable,
    StateError,
    UnknownRequestError,
)
from mtpstate._kernels import slots as T
from mtpstate.tools.reference import LoopRequestTable
from mtpstate.tools.sim import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, Simulator

sim_configs = st.fixed_dictionaries(
    {
        "max_num_reqs": st.integers(1, 24),
        "max_model_len": st.sampled_from([64, 300, 1024]),
        "max_num_batched_tokens": st.sampled_from([8, 64, 512]),
        "block_sizes": st.sampled_from([(16,), (4, 32), (16, 16, 64)]),
        "arrivals_per_step": st.floats(0.2, 4),
        **SIM_KNOBS,
    }
)


def _tables(cfg, **kw):
    shape = dict(max_num_reqs=cfg["max_num_reqs"], max_model_len=cfg["max_model_len"], block_sizes=cfg["block_sizes"])
    return RequestTable(**shape, **kw), LoopRequestTable(**shape)


def _short_lengths(cfg):
    L = cfg["max_model_len"]
    return {**cfg, "prompt_len": (1, max(2, L // 3)), "output_len": (1, max(2, L // 4))}


@given(cfg=sim_configs, steps=st.integers(1, 60), fresh=st.booleans())
def test_differential_fast_path(cfg, steps, fresh):
    sim = Simulator(**_short_lengths(cfg))
    fast, loop = _tables(cfg)
    for _ in range(steps):
        so = sim.step()
        if fresh:  # freshly unpickled ids, as a worker process receives them
            so = pickle.loads(pickle.dumps(so))
        fast.apply(so)
        loop.apply(so)
        assert_tables_agree(fast, loop)
        # the fixed semantics never drift from the scheduler's truth
        for rid, n in sim.truth.items():
            assert fast.num_computed_tokens[fast.rows([rid])[0]] == n


@given(cfg=sim_configs, steps=st.integers(1, 30), collide=st.booleans())
def test_differential_generic_path(cfg, steps, collide):
    rng = np.random.default_rng(cfg["seed"])
    sim = Simulator(**_short_lengths(cfg))
    fast, loop = _tables(cfg, _hash_bits=0 if collide else 63)
    for _ in range(steps):
        so = sim.step()
        fast.apply(genericize(so, rng))
        loop.apply(so)
        assert_tables_agree(fast, loop)


def test_phases_match_apply():
    cfg = dict(max_num_reqs=16, max_model_len=512, block_sizes=(16,))
    sim = Simulator(**cfg, num_spec=2, preempt_prob=0.2, seed=3, prompt_len=(1, 100), output_len=(1, 40))
    a = RequestTable(**cfg)
    b = LoopRequestTable(**cfg)
    for so in sim.run(80):
        a.finish(set(so.finished_req_ids) | set(so.preempted_req_ids or ()))
        a.add(so.scheduled_new_reqs)
        a.update(so.scheduled_cached_reqs)
        b.apply(so)
        assert_tables_agree(a, b)


def test_update_arrays_matches_update():
    cfg = dict(max_num_reqs=32, max_model_len=512, block_sizes=(16, 32))
    sim = Simulator(**cfg, num_spec=3, accept=0.5, seed=5, prompt_len=(1, 60), output_len=(5, 60))
    a = RequestTable(**cfg)
    b = LoopRequestTable(**cfg)
    for i, so in enumerate(sim.run(60)):
        a.finish(set(so.finished_req_ids) | set(so.preempted_req_ids or ()))
        a.add(so.scheduled_new_reqs)
        c = so.scheduled_cached_reqs
        offsets, values = [], []
        for g in range(2):
            counts = [0 if blk is None else len(blk[g]) for blk in c.new_block_ids]
            offsets.append(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
            values.append(np.array([x for blk in c.new_block_ids if blk is not None for x in blk[g]], np.int32))
        keys = c.req_ids if i % 2 else a.rows(c.req_ids)
        rows = a.update_arrays(keys, np.array(c.num_computed_tokens, np.int64), offsets, values)
        b.apply(so)
        assert rows.tolist() == b.rows(c.req_ids).tolist()
        assert_tables_agree(a, b)


# ----------------------------------------------------------------------------
# bad input: raises a StateError subclass, changes nothing, next step works


def _new(rid, n=4, nct=0, blocks=None, max_tokens=8, prefill=None):
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=list(range(n)),
        sampling_params=SamplingParams(max_tokens),
        block_ids=blocks if blocks is not None else ([0],),
        num_computed_tokens=nct,
        prefill_token_ids=prefill,
    )


def _cached(ids, ncts, blocks=None, resumed=()):
    return CachedRequestData(
        req_ids=list(ids),
        num_computed_tokens=list(ncts),
        new_block_ids=list(blocks) if blocks is not None else [None] * len(ids),
        resumed_req_ids=set(resumed),
    )


def _so(new=(), cached=None, fin=(), pre=None):
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or _cached([], []),
        finished_req_ids=set(fin),
        preempted_req_ids=pre,
    )


def _fresh_table():
    t = RequestTable(max_num_reqs=4, max_model_len=64, block_sizes=[16], max_num_blocks_per_group=[4])
    t.apply(_so(new=[_new("a", blocks=([1, 2],)), _new("b")]))
    t.apply(_so(cached=_cached(["a", "b"], [4, 4])))
    return t


BAD_STEPS = {
    "unknown cached id": (_so(cached=_cached(["a", "zz"], [5, 5])), UnknownRequestError),
    "cached id finished in this step": (_so(fin=["b"], cached=_cached(["a", "b"], [5, 5])), UnknownRequestError),
    "unequal cached lists": (
        _so(cached=CachedRequestData(["a", "b"], set(), [], [None], [5, 5], [])),
        InvalidStepError,
    ),
    "negative num_computed_tokens": (_so(cached=_cached(["a"], [-1])), InvalidStepError),
    "num_computed_tokens above max_model_len": (_so(cached=_cached(["a"], [65])), InvalidStepError),
    "new nct above prefill_len": (_so(new=[_new("c", n=4, nct=5)]), InvalidStepError),
    "prompt longer than max_model_len": (_so(new=[_new("c", n=65)]), InvalidStepError),
    "block row overflow (cached)": (_so(cached=_cached(["a"], [5], [([3, 4, 5],)])), InvalidStepError),
    "block row overflow (new)": (_so(new=[_new("c", blocks=([1, 2, 3, 4, 5],))]), InvalidStepError),
    "wrong number of groups (new)": (_so(new=[_new("c", blocks=([1], [2]))]), InvalidStepError),
    "wrong number of groups (cached)": (_so(cached=_cached(["a"], [5], [([1], [2])])), InvalidStepError),
    "negative block id": (_so(cached=_cached(["a"], [5], [([-3],)])), InvalidStepError),
    "non-str new id": (_so(new=[_new(7)]), StateError),
    "non-str cached id": (_so(cached=_cached(["a", 3], [5, 5])), StateError),
    "non-int count": (_so(cached=_cached(["a"], [5.5])), InvalidStepError),
    "bool count": (_so(cached=_cached(["a"], [True])), InvalidStepError),
    "same new id twice": (_so(new=[_new("c"), _new("c")]), DuplicateRequestError),
    "same cached id twice": (_so(cached=_cached(["a", "a"], [5, 5])), DuplicateRequestError),
    "more new requests than free rows": (_so(new=[_new("c"), _new("d"), _new("e")]), CapacityError),
    "negative token id": (_so(new=[_new("c", prefill=[1, -2, 3])]), InvalidStepError),
    "negative max_tokens": (_so(new=[_new("c", max_tokens=-1)]), InvalidStepError),
    "bad step after good parts": (
        _so(fin=["a"], new=[_new("c"), _new("a2")], cached=_cached(["b", "c", "q"], [5, 1, 1])),
        UnknownRequestError,
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_STEPS))
def test_bad_step_changes_nothing(name):
    so, err = BAD_STEPS[name]
    t = _fresh_table()
    before = table_snapshot(t)
    with pytest.raises(err) as info:
        t.apply(so)
    assert isinstance(info.value, StateError)
    assert_same_snapshot(before, table_snapshot(t))
    # the next good step works and agrees with the oracle
    loop = LoopRequestTable(max_num_reqs=4, max_model_len=64, block_sizes=[16], max_num_blocks_per_group=[4])
    loop.apply(_so(new=[_new("a", blocks=([1, 2],)), _new("b")]))
    loop.apply(_so(cached=_cached(["a", "b"], [4, 4])))
    good = _so(fin=["b"], new=[_new("c", n=9, nct=3, blocks=([7, 8],))], cached=_cached(["a"], [6], [([9],)]))
    t.apply(good)
    loop.apply(good)
    assert_tables_agree(t, loop)
    t.apply(_so(cached=_cached(["c", "a"], [9, 7])))
    loop.apply(_so(cached=_cached(["c", "a"], [9, 7])))
    assert_tables_agree(t, loop)


def test_error_messages_name_the_request():
    t = _fresh_table()
    with pytest.raises(UnknownRequestError, match="'zz'"):
        t.apply(BAD_STEPS["unknown cached id"][0])
    with pytest.raises(InvalidStepError, match="'a'.*group 0"):
        t.apply(BAD_STEPS["block row overflow (cached)"][0])
    with pytest.raises(InvalidStepError, match="'c'"):
        t.apply(BAD_STEPS["new nct above prefill_len"][0])


SAME_STEP_TABLE = dict(max_num_reqs=4, max_model_len=64, block_sizes=[16], max_num_blocks_per_group=[4])


def same_step_steps():
    """(set-up steps, steps) where a live id is re-sent, a finished id is
    re-added in the same step, cached ids name requests added by the very
    same step (an element staged twice), and a preempted request comes back
    (for a table of SAME_STEP_TABLE)."""
    setup = [_so(new=[_new("a", blocks=([1, 2],)), _new("b")]), _so(cached=_cached(["a", "b"], [4, 4]))]
    steps = [
        _so(new=[_new("a", n=6, nct=2, blocks=([5],))], cached=_cached(["b"], [4])),
        _so(fin=["b"], new=[_new("b", n=3, blocks=([6],))], cached=_cached(["a", "b"], [3, 1], [None, ([7],)])),
        _so(new=[_new("x", n=2)], cached=_cached(["x", "a"], [1, 4])),
        _so(pre={"a"}, new=[_new("a", n=8, nct=8, prefill=list(range(8)), blocks=([1],))]),
        _so(cached=_cached(["a", "b", "x"], [8, 2, 2], [([2],), None, ([3],)], resumed={"a"})),
    ]
    return setup, steps


def test_resent_and_same_step_semantics():
    """A re-sent live id is removed and added again; a finished id re-added in
    the same step is live; cached ids of requests added by this very step
    are found."""
    t = _fresh_table()
    loop = LoopRequestTable(max_num_reqs=4, max_model_len=64, block_sizes=[16], max_num_blocks_per_group=[4])
    setup, steps = same_step_steps()
    for so in setup:
        loop.apply(so)
    for so in steps:
        t.apply(so)
        loop.apply(so)
        assert_tables_agree(t, loop)


def test_long_unicode_and_surrogate_ids():
    t = RequestTable(max_num_reqs=8, max_model_len=64)
    ids = ["é" * 100, "\ud800x", "日本語" * 40, ""]
    t.apply(_so(new=[_new(r) for r in ids]))
    t.apply(_so(cached=_cached(ids, [1, 2, 3, 4])))
    assert t.num_computed_tokens[t.rows(ids)].tolist() == [1, 2, 3, 4]
    assert all(r in t for r in ids)


_ROWS_SCRIPT = """
from mtpstate import RequestTable
from mtpstate.tools.sim import Simulator
sim = Simulator(max_num_reqs=16, max_model_len=256, preempt_prob=0.3, abort_prob=0.2, abort_waiting_prob=0.2,
                num_spec=2, prompt_len=(1, 60), output_len=(1, 30), seed=11)
t = RequestTable(max_num_reqs=16, max_model_len=256)
out = []
for so in sim.run(80):
    t.apply(so)
    out.append(sorted((int(r), i) for i, r in zip(so.num_scheduled_tokens, t.rows(list(so.num_scheduled_tokens)))))
print(out)
"""


def test_rows_identical_across_hash_seeds():
    outs = set()
    for seed in ("0", "7", "4242"):
        r = subprocess.run(
            [sys.executable, "-c", _ROWS_SCRIPT],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        )
        outs.add(r.stdout)
    assert len(outs) == 1


def test_constructor_and_views():
    t = RequestTable(max_num_reqs=8, max_model_len=100, block_sizes=[16, 32])
    assert [bt.shape for bt in t.block_tables] == [(8, 7), (8, 4)]
    assert t.num_blocks.shape == (2, 8) and t.token_ids.shape == (8, 100)
    assert np.shares_memory(t.num_computed_tokens, t._state)
    with pytest.raises(ValueError):
        RequestTable(max_num_reqs=0, max_model_len=10)
    with pytest.raises(ValueError):
        RequestTable(max_num_reqs=2, max_model_len=10, block_sizes=[16], max_num_blocks_per_group=[1, 2])
    assert "RequestTable" in repr(t) and len(t) == 0 and "x" not in t
    assert t.transfer_stats() == {"bytes": 0, "copies": 0, "path": None}
    with pytest.raises(StateError):
        t.device_tensors


def test_reference_counts_balance():
    """The table holds exactly one reference to each id of the current
    prediction, across identity hits, fresh ids, rejected steps and
    finishes, and gives them all back when it is deleted."""
    import gc

    ids = [f"cmpl-{i:032x}-0" for i in range(50)]
    base = [sys.getrefcount(x) for x in ids]
    t = RequestTable(max_num_reqs=64, max_model_len=64)
    t.apply(_so(new=[_new(r) for r in ids]))
    for step in range(6):
        keep = ids[step:]  # one finished per step
        t.apply(_so(fin=[ids[step - 1]] if step else [], cached=_cached(keep, [1] * len(keep))))
        t.apply(_so(cached=_cached(keep, [2] * len(keep))))  # identity hits
        with pytest.raises(StateError):
            t.apply(_so(cached=_cached(keep + ["zz"], [2] * (len(keep) + 1))))
        fresh = pickle.loads(pickle.dumps(keep))
        t.apply(_so(cached=_cached(fresh, [3] * len(keep))))  # byte-compare path
        t.apply(_so(cached=_cached(keep, [4] * len(keep))))
        n_keep = len(keep)
        del keep, fresh
        gc.collect()  # the rejected step's traceback held its lists
        now = [sys.getrefcount(x) for x in ids]
        owned = int(t._ctx[T.TB_PREV_OWNED])
        assert [n - b for n, b in zip(now, base)] == [0] * step + [owned] * n_keep
    # the same objects step after step: the table owns them and predicts by identity
    keep = ids[6:]
    for _ in range(20):
        t.apply(_so(cached=_cached(keep, [5] * len(keep))))
    assert int(t._ctx[T.TB_PREV_OWNED]) == 1
    now = [sys.getrefcount(x) for x in ids]
    assert [now[i] - base[i] for i in range(6, len(ids))] == [2] * len(keep)  # the table and the list `keep`
    del keep
    del t
    gc.collect()
    assert [sys.getrefcount(x) for x in ids] == base


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["new", "cached"])
def test_long_differential_traces(mode):
    """Exhaustive: long, busy traces at a few hundred running requests."""
    cfg = dict(max_num_reqs=256, max_model_len=2048, block_sizes=(16, 64))
    for seed in range(3):
        run_differential(
            cfg,
            1500,
            num_spec=3,
            accept=0.6,
            arrivals_per_step=8,
            preempt_prob=0.3,
            abort_prob=0.2,
            abort_waiting_prob=0.2,
            prefix_hit_prob=0.3,
            remote_kv_prob=0.2,
            resume_mode=mode,
            prompt_len=(1, 600),
            output_len=(1, 300),
            seed=seed,
        )


def test_works_without_torch():
    """torch is optional: a host-only table never imports it, and asking for
    a device without it is a clear StateError."""
    script = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
import mtpstate
from mtpstate.tools.sim import Simulator
t = mtpstate.RequestTable(max_num_reqs=8, max_model_len=256)
for so in Simulator(max_num_reqs=8, max_model_len=256, seed=1).run(20):
    t.apply(so)
try:
    mtpstate.RequestTable(max_num_reqs=8, max_model_len=256, device="cpu")
except mtpstate.StateError as e:
    print("refused:", e)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "refused: the device mirror needs torch" in r.stdout


def test_tables_refuse_copies():
    import copy

    from mtpstate import RequestIndex

    for obj in (RequestTable(max_num_reqs=2, max_model_len=8), RequestIndex(2)):
        for f in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be copied"):
                f(obj)


@pytest.mark.parametrize(
    "nct, blocks", [([4], [None]), ([], [None]), ([4], []), ([4, 5], [None, None])], ids=["1/1", "0/1", "1/0", "2/2"]
)
def test_unequal_cached_lists_with_empty_req_ids(nct, blocks):
    """docs/api.md: unequal cached lists raise InvalidStepError, whatever
    req_ids holds (they used to pass when req_ids was empty)."""
    t = RequestTable(max_num_reqs=4, max_model_len=64)
    c = CachedRequestData(req_ids=[], num_computed_tokens=nct, new_block_ids=blocks)
    with pytest.raises(InvalidStepError, match="entries, req_ids has 0"):
        t.apply(SchedulerOutput(scheduled_cached_reqs=c))
    assert len(t) == 0


def test_finished_ids_are_released_by_the_step_that_finishes_them():
    """The table's references to remembered id objects end with the step
    that finishes them, also when no update follows (finish() alone)."""
    t = RequestTable(max_num_reqs=8, max_model_len=64)
    ids = ["".join(["req-", str(i)]) for i in range(4)]  # fresh objects, not interned
    new = [NewRequestData(r, [1, 2], SamplingParams(4), ([i],), 0) for i, r in enumerate(ids)]
    t.apply(SchedulerOutput(scheduled_new_reqs=new))
    base = [sys.getrefcount(r) for r in ids]
    for _ in range(3):
        cached = CachedRequestData(list(ids), set(), [[]] * 4, [None] * 4, [2] * 4, [0] * 4)
        t.apply(SchedulerOutput(scheduled_cached_reqs=cached))
        del cached
    assert [sys.getrefcount(r) for r in ids] == [b + 1 for b in base]  # remembered for the next prediction
    t.finish(ids[:2])
    assert [sys.getrefcount(r) for r in ids] == [base[0], base[1], base[2] + 1, base[3] + 1]
    t.apply(SchedulerOutput(finished_req_ids=set(ids[2:])))
    for _ in range(3):
        t.finish([])
    assert [sys.getrefcount(r) for r in ids] == base
    # the next update is predicted by hash again, and still agrees
    t.apply(SchedulerOutput(scheduled_new_reqs=[NewRequestData(ids[0], [1], SamplingParams(4), ([9],), 0)]))
    t.apply(SchedulerOutput(scheduled_cached_reqs=CachedRequestData([ids[0]], set(), [[]], [None], [1], [0])))
    assert t.num_computed_tokens[t.rows([ids[0]])].tolist() == [1]


class _CountedNew:
    """A NewRequestData that counts each attribute read (the kernel reads
    them through PyObject_GetAttr, so __getattribute__ sees every one)."""

    def __init__(self, reads, raises=None, **attrs):
        object.__setattr__(self, "_reads", reads)
        object.__setattr__(self, "_raises", raises)
        object.__setattr__(self, "_attrs", attrs)

    def __getattribute__(self, name):
        if name.startswith("_"):
            return object.__getattribute__(self, name)
        attrs = object.__getattribute__(self, "_attrs")
        rid = attrs.get("req_id")
        reads = object.__getattribute__(self, "_reads")
        reads[(rid, name)] = reads.get((rid, name), 0) + 1
        if name == object.__getattribute__(self, "_raises"):
            raise KeyboardInterrupt if name == "num_computed_tokens" else ValueError(f"no {name}")
        if name not in attrs:
            raise AttributeError(name)
        return attrs[name]


def _counted(reads, rid, tokens=(1, 2, 3), raises=None, **kw):
    attrs = dict(
        req_id=rid,
        prompt_token_ids=list(tokens),
        prefill_token_ids=None,
        block_ids=([1],),
        num_computed_tokens=0,
        sampling_params=SamplingParams(8),
    )
    attrs.update(kw)
    return _CountedNew(reads, raises, **attrs)


@pytest.mark.parametrize(
    "shape",
    ["in place", "a generator prompt", "no prefill attribute", "a long id", "raises at the last", "a numpy prompt"],
)
def test_new_request_attributes_are_read_once(shape):
    """Whatever path a step takes (in place, the Python reader taking over
    from the kernel, a retry for the key arena), each attribute of each new
    request is read once: a property with effects runs once."""
    reads = {}
    reqs = [_counted(reads, "a"), _counted(reads, "b", tokens=range(5))]
    if shape == "a generator prompt":
        reqs[0]._attrs["prompt_token_ids"] = (x for x in [1, 2, 3])
    elif shape == "no prefill attribute":
        del reqs[1]._attrs["prefill_token_ids"]
    elif shape == "a long id":
        reqs.append(_counted(reads, "L" * 300))
    elif shape == "raises at the last":
        reqs.append(_counted(reads, "c", raises="block_ids"))
    elif shape == "a numpy prompt":
        reqs[1]._attrs["prompt_token_ids"] = np.arange(5, dtype=np.int16)
    t = RequestTable(max_num_reqs=4, max_model_len=64, block_sizes=[16], device=None)
    before = table_snapshot(t)
    if shape == "raises at the last":
        with pytest.raises(InvalidStepError, match="'c'.*block_ids.*no block_ids"):
            t.apply(_so(new=reqs))
        assert_same_snapshot(before, table_snapshot(t))
    else:
        t.apply(_so(new=reqs))
        assert len(t) == len(reqs)
    # every attribute up to the failing one, each read exactly once
    assert reads and set(reads.values()) == {1}, reads
    assert ("a", "req_id") in reads and ("b", "num_computed_tokens") in reads
    assert t.python_path_steps == 0


def test_a_base_exception_in_a_new_request_property_propagates():
    """KeyboardInterrupt raised while the kernel reads an attribute is not
    turned into a StateError (nor swallowed); the table is unchanged."""
    reads = {}
    t = _fresh_table()
    before = table_snapshot(t)
    with pytest.raises(KeyboardInterrupt):
        t.apply(_so(new=[_counted(reads, "c"), _counted(reads, "d", raises="num_computed_tokens")]))
    assert_same_snapshot(before, table_snapshot(t))
    assert reads[("d", "num_computed_tokens")] == 1
    t.apply(_so(cached=_cached(["a", "b"], [5, 5])))  # and the table goes on
