"""RequestIndex against a dict model: stateful properties, collisions, churn,
determinism across PYTHONHASHSEED, and rejected calls changing nothing."""

import heapq
import pickle
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_same_arrays, index_snapshot
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mtpstate
from mtpstate import CapacityError, DuplicateRequestError, RequestIndex, StateError, UnknownRequestError

ID = st.one_of(
    st.text(min_size=0, max_size=80),
    st.from_regex(r"cmpl-[0-9a-f]{32}-[0-9]", fullmatch=True),
    st.sampled_from(["a", "b", "ç", "日本", "\ud800", "x" * 200, ""]),
)


class IndexModel(RuleBasedStateMachine):
    """Random interleavings of batched calls; a dict + heap is the model."""

    @initialize(capacity=st.integers(1, 24), hash_bits=st.sampled_from([0, 2, 63]))
    def setup(self, capacity, hash_bits):
        self.ix = RequestIndex(capacity, _hash_bits=hash_bits)
        self.capacity = capacity
        self.model = {}
        self.free = list(range(capacity))

    def _check_unchanged(self, before):
        assert_same_arrays(before, index_snapshot(self.ix))

    @rule(ids=st.lists(ID, max_size=8))
    def insert(self, ids):
        before = index_snapshot(self.ix)
        bad = len(set(ids)) < len(ids) or any(i in self.model for i in ids) or len(ids) > len(self.free)
        if bad:
            with pytest.raises(StateError):
                self.ix.insert(ids)
            self._check_unchanged(before)
            return
        rows = self.ix.insert(ids)
        expect = [heapq.heappop(self.free) for _ in ids]
        assert rows.tolist() == expect
        assert rows.dtype == np.int32
        for i, r in zip(ids, expect):
            self.model[i] = r

    @rule(ids=st.lists(ID, max_size=8), take_live=st.booleans())
    def remove(self, ids, take_live):
        if take_live and self.model:
            ids = ids + list(self.model)[: len(ids) + 1]
        rows = self.ix.remove(ids)
        expect = []
        for i in ids:
            r = self.model.pop(i, -1)
            if r >= 0:
                heapq.heappush(self.free, r)
            expect.append(r)
        assert rows.tolist() == expect

    @rule(ids=st.lists(ID, max_size=8), take_live=st.booleans())
    def find(self, ids, take_live):
        if take_live and self.model:
            ids = ids + list(self.model) * 2
        assert self.ix.find(ids).tolist() == [self.model.get(i, -1) for i in ids]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def lookup(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=10))
        assert self.ix.lookup(ids).tolist() == [self.model[i] for i in ids]

    @rule(extra=ID)
    def lookup_unknown(self, extra):
        if extra in self.model:
            return
        before = index_snapshot(self.ix)
        ids = list(self.model)[:3] + [extra]
        with pytest.raises(UnknownRequestError) as err:
            self.ix.lookup(ids)
        assert repr(extra) in str(err.value)
        self._check_unchanged(before)

    @rule(bad=st.sampled_from([1, None, b"x", 2.5]))
    def non_str(self, bad):
        before = index_snapshot(self.ix)
        with pytest.raises(StateError, match="must be str"):
            self.ix.find(["ok-id-not-live-zz", bad])
        with pytest.raises(StateError):
            self.ix.insert(["ok-id-not-live-zz", bad])
        self._check_unchanged(before)

    @invariant()
    def agrees(self):
        assert len(self.ix) == len(self.model)
        for i, r in list(self.model.items())[:5]:
            assert i in self.ix
            assert self.ix.req_id(r) == i
        live = np.flatnonzero(self.ix._key_len >= 0).tolist()
        assert live == sorted(self.model.values())
        # no tombstones: every occupied slot is a live row
        assert int((self.ix._slots >= 0).sum()) == len(self.model)


TestIndexModel = IndexModel.TestCase


def test_forced_collisions_never_return_another_row():
    # _hash_bits=0: every id hashes to the same value
    ix = RequestIndex(64, _hash_bits=0)
    ids = [f"req-{i}" for i in range(64)]
    rows = ix.insert(ids)
    assert rows.tolist() == list(range(64))
    assert ix.lookup(ids[::-1]).tolist() == list(range(63, -1, -1))
    assert ix.find(["req-64", "req-1x"]).tolist() == [-1, -1]
    ix.remove(ids[::2])
    assert ix.find(ids).tolist() == [-1 if i % 2 == 0 else i for i in range(64)]
    assert ix.insert(["z"]).tolist() == [0]


def test_ids_that_differ_past_the_first_word_and_in_length():
    base = "cmpl-0123456789abcdef0123456789abcdef-"
    ids = [base + "0", base + "1", base, base + "00", base[:-1], "", "\0", "\0\0"]
    ix = RequestIndex(16, _hash_bits=0)
    ix.insert(ids)
    assert ix.lookup(ids).tolist() == list(range(len(ids)))


def test_churn_does_not_degrade():
    """A million insert/remove cycles: the table keeps no tombstones and
    lookups stay exact."""
    cap = 1024
    ix = RequestIndex(cap)
    live = [f"cmpl-{i:032x}-0" for i in range(cap // 2)]
    ix.insert(live)
    rng = np.random.default_rng(0)
    nxt = cap
    cycles = 0
    while cycles < 1_000_000:
        k = 256
        pos = rng.choice(len(live), size=k, replace=False)
        gone = [live[p] for p in pos]
        ix.remove(gone)
        fresh = [f"cmpl-{nxt + j:032x}-0" for j in range(k)]
        nxt += k
        rows = ix.insert(fresh)
        for p, f in zip(pos, fresh):
            live[p] = f
        cycles += k
    assert len(ix) == len(live)
    assert int((ix._slots >= 0).sum()) == len(live)
    rows = ix.lookup(live)
    assert len(set(rows.tolist())) == len(live)
    assert all(ix.req_id(r) == i for r, i in zip(rows[:100], live[:100]))
    # mean probe distance stays that of a fresh table at this load
    mask = len(ix._slots) - 1
    occupied = np.flatnonzero(ix._slots >= 0)
    homes = (ix._row_hash[ix._slots[occupied] & 0xFFFFFFFF] & np.uint64(mask)).astype(np.int64)
    dist = (occupied - homes) & mask
    assert dist.mean() < 2.0, dist.mean()
    del rows


def test_rejected_calls_change_nothing():
    ix = RequestIndex(4)
    ix.insert(["a", "b"])
    before = index_snapshot(ix)
    with pytest.raises(DuplicateRequestError, match="already live"):
        ix.insert(["c", "a"])
    with pytest.raises(DuplicateRequestError, match="twice"):
        ix.insert(["c", "c"])
    with pytest.raises(CapacityError):
        ix.insert(["c", "d", "e"])
    with pytest.raises(StateError):
        ix.insert(["c", 5])
    with pytest.raises(StateError):
        ix.remove(["a", None])
    with pytest.raises(StateError):
        ix.insert("abc")
    assert_same_arrays(before, index_snapshot(ix))
    assert ix.insert(["c", "d"]).tolist() == [2, 3]


def test_generic_inputs_and_fresh_strings():
    ix = RequestIndex(8)
    ids = ["a", "b", "c"]
    ix.insert(tuple(ids))
    assert ix.lookup(np.array(["c", "a"])).tolist() == [2, 0]
    assert ix.find(iter(["b", "q"])).tolist() == [1, -1]
    fresh = pickle.loads(pickle.dumps(ids))
    assert ix.lookup(fresh).tolist() == [0, 1, 2]

    class S(str):
        pass

    assert ix.lookup([S("b")]).tolist() == [1]
    assert ix.insert([]).tolist() == []
    assert ix.lookup([]).tolist() == []


def test_errors_are_keyerror_and_stateerror():
    ix = RequestIndex(2)
    with pytest.raises(KeyError):
        ix.lookup(["nope"])
    assert issubclass(UnknownRequestError, mtpstate.StateError)
    assert ix.req_id(1) is None
    with pytest.raises(StateError):
        ix.req_id(5)
    with pytest.raises(ValueError):
        RequestIndex(0)
    assert "nope" not in ix and 3 not in ix
    assert ix.capacity == 2
    assert "RequestIndex" in repr(ix)


_ROWS_SCRIPT = """
import mtpstate
ix = mtpstate.RequestIndex(64)
ids = [f"id-{i}" for i in range(40)]
ix.insert(set(ids[:20]) and sorted(ids[:20]))
ix.remove(set(ids[5:15]))
ix.insert(ids[20:40])
print(ix.find(ids).tolist())
"""


def test_rows_do_not_depend_on_hash_seed():
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        r = subprocess.run([sys.executable, "-c", _ROWS_SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.add(r.stdout)
    assert len(outs) == 1
