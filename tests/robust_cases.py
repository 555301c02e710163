"""Adversarial inputs for RequestTable.apply, run by test_robustness.py in
subprocesses (a crash fails that test instead of killing the run).

Each case gives a bad or unusual step and, where the input is valid, the
equivalent plain step for the loop oracle. After the case: a rejected step
must raise a StateError subclass naming the request and field and leave
every array, the index and the prediction state bitwise unchanged; an
accepted step must agree with LoopRequestTable; and the next valid steps
must agree too.

Run as ``python robust_cases.py MODE`` (MODE: host, mirror); prints one
line per case and "ALL OK" at the end.
"""

from __future__ import annotations

import array
import gc
import sys

import numpy as np
from helpers import assert_same_snapshot, assert_tables_agree, table_snapshot

from mtpstate import RequestTable, StateError
from mtpstate.tools.reference import LoopRequestTable
from mtpstate.tools.sim import SamplingParams
from mtpstate.tools.workloads import TokenBuffer, VllmCachedRequestData

CFG = dict(max_num_reqs=8, max_model_len=64, block_sizes=(16,))


class NR:  # a NewRequestData with plain attributes (vLLM 0.34 shape)
    def __init__(self, req_id, tokens, nct=0, blocks=None, max_tokens=8):
        self.req_id = req_id
        self.prompt_token_ids = tokens
        self.prefill_token_ids = tokens
        self.sampling_params = SamplingParams(max_tokens)
        self.block_ids = blocks if blocks is not None else ([1],)
        self.num_computed_tokens = nct

    @property
    def prompt_len(self):
        return len(self.prompt_token_ids)


class SO:  # a SchedulerOutput
    def __init__(self, new=(), cached=None, fin=(), pre=()):
        self.scheduled_new_reqs = list(new)
        self.scheduled_cached_reqs = cached if cached is not None else VllmCachedRequestData([], [], [], [], [])
        self.finished_req_ids = set(fin)
        self.preempted_req_ids = set(pre)
        ids = list(self.scheduled_cached_reqs.req_ids) if cached is not None else []
        self.num_scheduled_tokens = {r: 1 for r in ids}


def cached(ids, nct, blocks):
    return VllmCachedRequestData(list(ids), [], list(blocks), list(nct), [0] * len(ids))


class World:
    """A table and its oracle, with a few live requests and a step counter."""

    def __init__(self, **kw):
        self.t = RequestTable(**CFG, decode_query_len=2, **kw)
        self.loop = LoopRequestTable(**CFG)
        self.k = 0
        self.nct = {}
        for i in range(3):
            self.both(SO(new=[NR(f"r{i}", TokenBuffer(range(10 + i)), nct=2, blocks=([i],))]))
            self.nct[f"r{i}"] = 2
        self.valid_steps(2)

    def both(self, so, so2=None):
        self.t.apply(so)
        self.loop.apply(so2 if so2 is not None else so)
        assert_tables_agree(self.t, self.loop)

    def plan(self, busy):
        """A valid step: every live request advances; busy steps also
        finish one and add one."""
        self.k += 1
        ids = sorted(self.loop.req_id_to_index)
        fin, new = [], []
        if busy and len(ids) > 1:
            fin = [ids.pop()]
            new = [(f"n{self.k}", list(range(5 + self.k % 7)))]
        for r in ids:
            self.nct[r] = min(self.nct.get(r, 0) + 1, 60)
        blocks = [([100 + self.k],) if (i + self.k) % 3 == 0 else None for i in range(len(ids))]
        return ids, [self.nct[r] for r in ids], blocks, fin, new

    def build(self, plan, tokens=TokenBuffer):
        ids, nct, blocks, fin, new = plan
        return SO(
            new=[NR(r, tokens(toks), blocks=([50 + len(r)],)) for r, toks in new],
            cached=cached(ids, nct, blocks),
            fin=fin,
        )

    def valid_steps(self, n, busy=False):
        for i in range(n):
            p = self.plan(busy or i % 2 == 1)
            for r, _ in p[4]:
                self.nct[r] = 0
            self.both(self.build(p), self.build(p))


def run_case(name, fn, busy, mirror):
    w = World(device="cpu" if mirror else None)
    plan = w.plan(busy)
    before = table_snapshot(w.t)
    bad, equiv, expect_words = fn(w, plan)
    try:
        w.t.apply(bad)
    except StateError as e:
        if equiv is not None:
            raise AssertionError(f"{name}: valid input rejected: {e}") from e
        msg = str(e)
        for word in expect_words:
            assert word in msg, f"{name}: message {msg!r} does not name {word!r}"
        assert_same_snapshot(before, table_snapshot(w.t))
        # the oracle skips the rejected step
        w.nct = {r: int(w.loop.num_computed_tokens[w.loop.req_id_to_index[r]]) for r in w.loop.req_id_to_index}
    else:
        if equiv is None:
            raise AssertionError(f"{name}: bad input accepted")
        w.loop.apply(equiv)
        assert_tables_agree(w.t, w.loop)
        for r, _ in plan[4]:
            w.nct[r] = 0
    w.valid_steps(3)
    if mirror:
        w.t.synchronize()
        dev = w.t.device_tensors
        np.testing.assert_array_equal(dev.num_computed_tokens.numpy(), w.t.num_computed_tokens)
        np.testing.assert_array_equal(dev.block_tables[0].numpy(), w.t.block_tables[0])


# ----------------------------------------------------------------------------
# the cases: fn(world, plan) -> (bad step, equivalent step or None, words the error must name)


def _c(ids, nct, blocks):
    return cached(ids, nct, blocks)


def none_field(attr):
    def fn(w, p):
        so = w.build(p)
        setattr(so.scheduled_cached_reqs, attr, None)
        return so, None, [attr]

    return fn


def none_new_field(attr, valid):
    def fn(w, p):
        p = (*p[:4], p[4] or [("nx", [1, 2, 3])])
        so = w.build(p)
        setattr(so.scheduled_new_reqs[0], attr, None)
        if not valid:
            return so, None, []
        eq = w.build(p)
        if attr == "sampling_params":
            eq.scheduled_new_reqs[0].sampling_params = SamplingParams(1)
        return so, eq, []

    return fn


def none_top(attr, valid):
    def fn(w, p):
        so = w.build(p)
        eq = w.build(p)
        setattr(so, attr, None)
        if attr in ("finished_req_ids", "preempted_req_ids"):
            setattr(eq, attr, set())  # (a request not finished stays live, unscheduled)
        if attr == "scheduled_new_reqs":
            eq.scheduled_new_reqs = []
        return so, (eq if valid else None), []

    return fn


def none_in_list(attr, word):
    def fn(w, p):
        so = w.build(p)
        getattr(so.scheduled_cached_reqs, attr)[0] = None
        return so, None, [word]

    return fn


class PropCached:
    """Every attribute a property returning a fresh list (freed as soon as
    the caller drops it)."""

    def __init__(self, ids, nct, blocks):
        self._ids, self._nct, self._blocks = ids, nct, blocks

    @property
    def req_ids(self):
        return [str(r) + "" for r in self._ids]

    @property
    def num_computed_tokens(self):
        return [int(x) + 0 for x in self._nct]

    @property
    def new_block_ids(self):
        return [None if b is None else tuple(list(g) for g in b) for b in self._blocks]


class PropNew(NR):
    @property
    def prefill_token_ids(self):
        return TokenBuffer(self._toks)

    @prefill_token_ids.setter
    def prefill_token_ids(self, v):
        self._toks = list(v)

    @property
    def block_ids(self):
        return tuple(list(g) for g in self._blocks)

    @block_ids.setter
    def block_ids(self, v):
        self._blocks = v


def props(w, p):
    ids, nct, blocks, fin, new = p
    so = SO(new=[PropNew(r, TokenBuffer(t), blocks=([50 + len(r)],)) for r, t in new], fin=fin)
    so.scheduled_cached_reqs = PropCached(ids, nct, blocks)
    return so, w.build(p), []


def generators(w, p):
    ids, nct, blocks, fin, new = p
    so = w.build(p)
    so.scheduled_new_reqs = (r for r in so.scheduled_new_reqs)
    so.finished_req_ids = (r for r in fin)
    c = so.scheduled_cached_reqs
    c.req_ids = (r for r in ids)
    c.num_computed_tokens = (x for x in nct)
    c.new_block_ids = (b for b in blocks)
    return so, w.build(p), []


def generator_with_resumed(w, p):
    so, eq, _ = generators(w, p)
    so.scheduled_cached_reqs.resumed_req_ids = set()
    return so, eq, []


def str_for_set(w, p):
    so = w.build(p)
    so.finished_req_ids = "r0r1"
    return so, None, ["finished_req_ids"]


class LyingStr(str):
    def __hash__(self):
        return 0

    def __eq__(self, other):
        return True


def lying_resumed(w, p):
    ids, nct, blocks, fin, new = p
    blocks = [([200 + i],) for i in range(len(ids))]
    so = SO(cached=cached([LyingStr(r) for r in ids], nct, blocks), fin=fin)
    so.scheduled_cached_reqs.resumed_req_ids = [LyingStr(ids[0])]
    eq = SO(cached=cached(ids, nct, blocks), fin=fin)
    eq.scheduled_cached_reqs.resumed_req_ids = {ids[0]}
    return so, eq, []


def lying_finished(w, p):
    ids, nct, blocks, fin, new = p
    so = SO(cached=cached(ids[:1], nct[:1], blocks[:1]))
    so.finished_req_ids = [LyingStr(r) for r in ids[1:]]  # (a set would merge them)
    eq = SO(cached=cached(ids[:1], nct[:1], blocks[:1]), fin=ids[1:])
    return so, eq, []


def reentrant(w, p):
    so = w.build(p)
    inner = w.build(p)
    c = so.scheduled_cached_reqs

    class Cb:
        req_ids = c.req_ids
        new_block_ids = c.new_block_ids

        @property
        def num_computed_tokens(self):
            w.t.apply(inner)  # re-enters the table mid-call
            return c.num_computed_tokens

    so.scheduled_cached_reqs = Cb()
    return so, None, ["re-entrant"]


def batch_case(kind):
    """Bad batch inputs (num_scheduled_tokens, scheduled_spec_decode_tokens)."""

    def fn(w, p):
        so = w.build(p)
        ids = list(so.num_scheduled_tokens)
        if kind == "unknown":
            so.num_scheduled_tokens["not-live"] = 1
            return so, None, ["not-live"]
        if kind == "count str":
            so.num_scheduled_tokens[ids[0]] = "1"
            return so, None, ["num_scheduled_tokens", ids[0]]
        if kind == "count huge":
            so.num_scheduled_tokens[ids[0]] = 2**80
            return so, None, ["num_scheduled_tokens", ids[0]]
        if kind == "drafts None":
            so.scheduled_spec_decode_tokens = {ids[0]: None}
            return so, None, ["scheduled_spec_decode_tokens", ids[0]]
        if kind == "not a dict":
            so.num_scheduled_tokens = list(so.num_scheduled_tokens.items())
            return so, None, ["num_scheduled_tokens"]
        if kind == "changed":
            nst = so.num_scheduled_tokens

            class Total:
                def __index__(self):
                    nst.pop(ids[0])
                    nst["late"] = 1
                    return len(nst)

            so.total_num_scheduled_tokens = Total()
            return so, None, ["late"]
        raise AssertionError(kind)

    return fn


def huge_id(w, p):
    p = (*p[:4], [("x" * (1 << 20), [1, 2])])
    return w.build(p), None, ["max_id_bytes"]


def int_value(where, value, valid=False, words=("num_computed_tokens",)):
    def fn(w, p):
        so = w.build(p)
        if where == "cached":
            so.scheduled_cached_reqs.num_computed_tokens[0] = value
        elif where == "block":
            p2 = list(p[2])
            p2[0] = ([7],)
            p = (p[0], p[1], p2, p[3], p[4])
            so = w.build(p)
            so.scheduled_cached_reqs.new_block_ids[0] = ([value],)
        else:
            p = (*p[:4], p[4] or [("nx", [1, 2, 3])])
            so = w.build(p)
            setattr(so.scheduled_new_reqs[0], where, value)
        if not valid:
            return so, None, list(words)
        eq = w.build(p)
        eq.scheduled_cached_reqs.num_computed_tokens[0] = value.__index__()
        return so, eq, []

    return fn


class Idx:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


def wrong_type(attr, value, words):
    def fn(w, p):
        so = w.build(p)
        obj = so.scheduled_cached_reqs if attr in ("new_block_ids", "req_ids", "num_computed_tokens") else so
        setattr(obj, attr, value)
        return so, None, list(words)

    return fn


def generator_prompt(w, p):
    p = (*p[:4], p[4] or [("nx", [1, 2, 3])])
    so = w.build(p, tokens=list)
    r = so.scheduled_new_reqs[0]
    r.prompt_token_ids = (x for x in list(r.prompt_token_ids))
    r.prefill_token_ids = None
    return so, w.build(p, tokens=list), []


def no_sampling_params(w, p):
    p = (*p[:4], p[4] or [("nx", [1, 2, 3])])
    so = w.build(p)
    del so.scheduled_new_reqs[0].sampling_params
    return so, None, ["sampling_params"]


def cached_none(w, p):
    so = w.build(p)
    so.scheduled_cached_reqs = None
    return so, None, ["scheduled_cached_reqs"]


def numpy_ids(w, p):
    so = w.build(p)
    c = so.scheduled_cached_reqs
    c.req_ids = np.array(c.req_ids)
    c.num_computed_tokens = np.array(c.num_computed_tokens, np.int64)
    return so, w.build(p), []


def token_shapes(kind):
    def fn(w, p):
        p = (*p[:4], p[4] or [("nx", [1, 2, 3])])
        conv = {
            "list": list,
            "tuple": tuple,
            "array-q": lambda t: array.array("q", t),
            "array-I": lambda t: array.array("I", t),
            "array-h": lambda t: array.array("h", t),
            "numpy-i4": lambda t: np.array(t, np.int32),
            "numpy-u8": lambda t: np.array(t, np.uint64),
            "numpy-strided": lambda t: np.repeat(np.array(t, np.int64), 2)[::2],
            "memoryview": lambda t: memoryview(array.array("i", t)),
            "bytes-ish": lambda t: bytearray(bytes(t)),
        }[kind]
        so = w.build(p, tokens=conv)
        if kind == "bytes-ish":  # a buffer of 1-byte items: converted, not read in place
            pass
        return so, w.build(p, tokens=list), []

    return fn


def negative_token(w, p):
    p = (*p[:4], [("nx", [1, -2, 3])])
    return w.build(p), None, ["prefill_token_ids", "'nx'"]


def duplicate_cached(w, p):
    ids, nct, blocks, fin, new = p
    return SO(cached=cached(ids + ids[:1], nct + nct[:1], blocks + blocks[:1]), fin=fin), None, [repr(ids[0])]


def lengths(w, p):
    so = w.build(p)
    so.scheduled_cached_reqs.num_computed_tokens.append(3)
    return so, None, ["num_computed_tokens"]


def bool_nct(w, p):
    so = w.build(p)
    so.scheduled_cached_reqs.num_computed_tokens[0] = True
    return so, None, ["num_computed_tokens"]


def int_subclass(w, p):
    class MyInt(int):
        pass

    so = w.build(p)
    c = so.scheduled_cached_reqs
    c.num_computed_tokens = [MyInt(x) for x in c.num_computed_tokens]
    return so, w.build(p), []


def surrogate_id(w, p):
    p = (*p[:4], [("bad\ud800id", [1, 2])])
    return w.build(p), w.build(p), []


# new requests whose attributes run code: the kernel reads them in place
# (PyObject_GetAttr), holding what it read until the call returns


def _with_new(w, p):
    p = (*p[:4], p[4] or [("nx", [1, 2, 3])])
    return p, w.build(p)


def raising_new_attr(attr):
    def fn(w, p):
        p, so = _with_new(w, p)
        r = so.scheduled_new_reqs[-1]

        class Raising(type(r)):
            pass

        def boom(self):
            raise ValueError("boom")

        setattr(Raising, attr, property(boom))
        r.__class__ = Raising
        r.__dict__.pop(attr, None)
        return so, None, [attr if attr != "max_tokens" else "max_tokens", "boom"]

    return fn


def raising_max_tokens(w, p):
    p, so = _with_new(w, p)

    class SP:
        @property
        def max_tokens(self):
            raise ValueError("boom")

    so.scheduled_new_reqs[-1].sampling_params = SP()
    return so, None, ["max_tokens", "boom"]


def no_prefill_attribute(w, p):
    """An older NewRequestData without prefill_token_ids: the prompt is the
    prefill."""
    p, so = _with_new(w, p)
    for r in so.scheduled_new_reqs:
        del r.prefill_token_ids
    return so, _with_new(w, p)[1], []


def property_changes_new_list(w, p):
    p, so = _with_new(w, p)
    lst = so.scheduled_new_reqs
    r = lst[-1]

    class Shrinks(type(r)):
        @property
        def block_ids(self):
            lst.clear()  # drops every request from the list mid-read
            return self._b

    r.__class__ = Shrinks
    r._b = r.__dict__.pop("block_ids")
    if len(lst) == 1:  # the list is read to its end: add a second to notice the change
        lst.append(_with_new(w, (*p[:4], [("ny", [4, 5])]))[1].scheduled_new_reqs[0])
    return so, None, ["scheduled_new_reqs", "changed"]


def property_reenters_from_new(w, p):
    p, so = _with_new(w, p)
    inner = w.build(p)
    r = so.scheduled_new_reqs[-1]

    class Reenters(type(r)):
        @property
        def num_computed_tokens(self):
            w.t.apply(inner)  # re-enters the table from inside the kernel's read
            return 0

    r.__class__ = Reenters
    r.__dict__.pop("num_computed_tokens")
    return so, None, ["num_computed_tokens", "re-entrant"]


def temporaries_freed_mid_read(w, p):
    """Every attribute a fresh object, the request itself dropped by the
    list's owner mid-read: all must stay alive until the call returns."""
    p, so = _with_new(w, p)
    eq = _with_new(w, p)[1]
    lst = so.scheduled_new_reqs
    for i, r in enumerate(list(lst)):
        toks, blocks, rid = list(r.prefill_token_ids), r.block_ids, r.req_id

        class Fresh:
            prompt_token_ids = property(lambda self, t=toks: TokenBuffer(t))
            prefill_token_ids = property(lambda self, t=toks: list(t))
            block_ids = property(lambda self, b=blocks: tuple(list(g) for g in b))
            num_computed_tokens = property(lambda self: int("0"))
            sampling_params = property(lambda self: SamplingParams(8))

            @property
            def req_id(self, rid=rid, i=i):
                lst[i] = None if i + 1 < len(lst) else lst[i]  # the list no longer holds earlier requests
                return (rid + ".")[:-1]

        lst[i] = Fresh()
    return so, eq, []


CASES = {
    "none:req_ids": none_field("req_ids"),
    "none:num_computed_tokens": none_field("num_computed_tokens"),
    "none:new_block_ids": none_field("new_block_ids"),
    "none:scheduled_cached_reqs": cached_none,
    "none:finished_req_ids": none_top("finished_req_ids", True),
    "none:preempted_req_ids": none_top("preempted_req_ids", True),
    "none:scheduled_new_reqs": none_top("scheduled_new_reqs", True),
    "none:new.req_id": none_new_field("req_id", False),
    "none:new.block_ids": none_new_field("block_ids", False),
    "none:new.num_computed_tokens": none_new_field("num_computed_tokens", False),
    "none:new.sampling_params": none_new_field("sampling_params", True),
    "none:in req_ids": none_in_list("req_ids", "cached request id"),
    "none:in num_computed_tokens": none_in_list("num_computed_tokens", "num_computed_tokens"),
    "properties returning temporaries": props,
    "generators": generators,
    "generator req_ids with resumed set": generator_with_resumed,
    "str for a set": str_for_set,
    "lying hash in resumed": lying_resumed,
    "lying hash in finished": lying_finished,
    "re-entrant callback": reentrant,
    "1 MiB id": huge_id,
    "nct 2**63": int_value("cached", 2**63),
    "nct -2**63-1": int_value("cached", -(2**63) - 1),
    "nct __index__ 2**70": int_value("cached", Idx(2**70)),
    "nct __index__ valid": int_value("cached", Idx(5), valid=True),
    "block id 2**64": int_value("block", 2**64, words=("new_block_ids",)),
    "new nct 2**63": int_value("num_computed_tokens", 2**63),
    "new max_tokens 2**70": int_value("sampling_params", SamplingParams(2**70), words=("max_tokens",)),
    "new_block_ids as int": wrong_type("new_block_ids", 5, ["new_block_ids"]),
    "finished as int": wrong_type("finished_req_ids", 5, ["finished_req_ids"]),
    "req_ids as str": wrong_type("req_ids", "r0", ["req_ids"]),
    "generator prompt": generator_prompt,
    "no sampling_params attribute": no_sampling_params,
    "numpy ids and counts": numpy_ids,
    **{
        f"tokens as {k}": token_shapes(k)
        for k in (
            "list",
            "tuple",
            "array-q",
            "array-I",
            "array-h",
            "numpy-i4",
            "numpy-u8",
            "numpy-strided",
            "memoryview",
            "bytes-ish",
        )
    },
    "negative token": negative_token,
    "duplicate cached id": duplicate_cached,
    "lists of different lengths": lengths,
    "bool num_computed_tokens": bool_nct,
    "int subclass values": int_subclass,
    "lone surrogate id": surrogate_id,
    **{f"new: {a} raises": raising_new_attr(a) for a in ("req_id", "prompt_token_ids", "block_ids", "sampling_params")},
    "new: max_tokens raises": raising_max_tokens,
    "new: no prefill_token_ids attribute": no_prefill_attribute,
    "new: a property empties the list": property_changes_new_list,
    "new: a property re-enters the table": property_reenters_from_new,
    "new: temporaries and a list emptied mid-read": temporaries_freed_mid_read,
    **{
        f"batch: {k}": batch_case(k)
        for k in ("unknown", "count str", "count huge", "drafts None", "not a dict", "changed")
    },
}


def main(mode):
    mirror = mode == "mirror"
    for name, fn in CASES.items():
        for busy in (False, True):
            print(f"case {name!r} busy={busy}", flush=True)
            run_case(name, fn, busy, mirror)
            gc.collect()
    print("ALL OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "host")
