"""Robustness: adversarial inputs never crash the process, never leave
half-applied or silently wrong state (cases in robust_cases.py, run in
subprocesses so a segfault fails a test); two threads on one table; memory
bounded against huge ids; quiet interpreter exit."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import FIELDS
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpstate import RequestTable, StateError
from mtpstate.tools.reference import LoopRequestTable
from mtpstate.tools.sim import Simulator

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(args, env_extra=None, timeout=600):
    env = dict(os.environ, **(env_extra or {}))
    p = subprocess.run([sys.executable, *args], cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
    return p


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    "mode,env",
    [
        ("host", {}),
        ("mirror", {}),
        ("host", {"PYTHONMALLOC": "debug"}),  # freed memory is poisoned: a use after free shows
        ("host", {"NUMBA_DISABLE_JIT": "1"}),
        ("mirror", {"NUMBA_DISABLE_JIT": "1"}),
    ],
    ids=["jit", "jit-mirror", "jit-malloc-debug", "nojit", "nojit-mirror"],
)
def test_adversarial_cases_in_subprocess(mode, env):
    if mode == "mirror" and not _has_torch():
        pytest.skip("the mirror needs torch (pip install 'mtpstate[torch]')")
    p = _run(["robust_cases.py", mode], env)
    last = [line for line in p.stdout.splitlines() if line.startswith("case")][-1:]
    assert p.returncode == 0 and "ALL OK" in p.stdout, (
        f"exit {p.returncode} after {last}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    )


def test_two_threads_on_one_table():
    """Two threads apply two independent simulated workloads (disjoint ids)
    to one table; the call guard serializes whole steps, so each request's
    state must equal its own oracle's."""
    cfg = dict(max_model_len=512, block_sizes=(16,))
    t = RequestTable(max_num_reqs=64, **cfg)
    errors = []
    oracles = []

    def worker(seed):
        sim = Simulator(
            max_num_reqs=32,
            **cfg,
            num_spec=3,
            accept=0.6,
            preempt_prob=0.1,
            abort_prob=0.1,
            prompt_len=(1, 100),
            output_len=(1, 60),
            seed=seed,
        )
        loop = LoopRequestTable(max_num_reqs=32, **cfg)
        oracles.append(loop)
        try:
            for so in sim.run(300):
                t.apply(so)
                loop.apply(so)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    _run_threads_then_compare(t, [threading.Thread(target=worker, args=(s,)) for s in (1, 2)], errors, oracles)


def _run_threads_then_compare(t, threads, errors, oracles):
    """Run the worker threads to the end; then every live request's state in
    the shared table equals its own oracle's."""
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    live = {r: (loop, row) for loop in oracles for r, row in loop.req_id_to_index.items()}
    assert len(t) == len(live)
    for r, (loop, row) in live.items():
        mine = t.rows([r])[0]
        for name in FIELDS:
            assert getattr(t, name)[mine] == getattr(loop, name)[row], (r, name)
        n = loop.num_blocks[0, row]
        assert t.num_blocks[0, mine] == n
        np.testing.assert_array_equal(t.block_tables[0][mine, :n], loop.block_tables[0][row, :n])


class _SleepyNew:
    """A new request whose every attribute read runs Python and releases the
    GIL (inside the kernel's read of new requests)."""

    def __init__(self, r):
        self._r = r

    def __getattr__(self, name):
        time.sleep(0.0002)  # another thread runs here
        return getattr(self._r, name)


def test_threads_while_the_kernel_reads_new_requests():
    """One thread's new requests release the GIL in each attribute read,
    mid-kernel; another thread applies its own steps to the same table
    meanwhile. The guard makes the second wait: every request's state equals
    its own oracle's."""
    cfg = dict(max_model_len=256, block_sizes=(16,))
    t = RequestTable(max_num_reqs=48, **cfg)
    errors, oracles = [], []

    def worker(seed, sleepy):
        sim = Simulator(max_num_reqs=24, **cfg, num_spec=2, accept=0.6, abort_prob=0.1,
                        prompt_len=(1, 60), output_len=(1, 30), seed=seed)  # fmt: skip
        loop = LoopRequestTable(max_num_reqs=24, **cfg)
        oracles.append(loop)
        try:
            for so in sim.run(60):
                if sleepy:
                    so.scheduled_new_reqs = [_SleepyNew(r) for r in so.scheduled_new_reqs]
                t.apply(so)
                loop.apply(so)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s, s == 3)) for s in (3, 4)]
    _run_threads_then_compare(t, threads, errors, oracles)
    assert t.python_path_steps == 0  # (read in place: the wrapper's attributes are the usual types)


def test_huge_ids_keep_memory_bounded():
    """Key storage follows the bytes of the live ids: a 1 MiB id over the cap
    is refused and allocates nothing; one under it costs about its own size,
    returned when it finishes (before: rows x the longest id ever seen)."""
    from mtpstate.tools.sim import NewRequestData, SamplingParams, SchedulerOutput

    def new(rid):
        return SchedulerOutput(scheduled_new_reqs=[NewRequestData(rid, [1], SamplingParams(2), ([0],), 0)])

    t = RequestTable(max_num_reqs=4096, max_model_len=64, block_sizes=(16,))
    before = t.index.key_bytes()
    with pytest.raises(StateError, match="max_id_bytes=65536"):
        t.apply(new("x" * (1 << 20)))
    assert t.index.key_bytes() == before and len(t) == 0
    assert not t.accepts_request_id("x" * (1 << 20)) and t.accepts_request_id("y" * 65536)
    t.apply(new("y" * 65536))
    assert t.index.key_bytes() - before <= 4 * 65536 + 16384  # ~2x the live id, not 4096 x 64 KiB
    assert t.rows(["y" * 65536]).tolist() == [0] and t.index.req_id(0) == "y" * 65536
    t.apply(SchedulerOutput(finished_req_ids={"y" * 65536}))
    assert t.index.key_bytes() - before <= 16384  # returned
    with pytest.raises(StateError, match="max_id_bytes"):
        t.index.insert(["z" * 70000])


def test_long_ids_of_every_length_work():
    """Ids around and beyond the inline 56 bytes, up to 64 KiB (a client's
    X-Request-Id), with shared prefixes: added, updated (by identity, by
    bytes with fresh objects, by hash), looked up, finished, re-added;
    agreeing with the loop oracle after every step."""
    import pickle

    from helpers import assert_tables_agree

    from mtpstate.tools.sim import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

    lengths = [1, 55, 56, 57, 63, 64, 65, 100, 1000, 4096, 65535, 65536]
    ids = [("cmpl-" + "p" * 60)[: max(0, n - 4)] + f"{i:04d}"[-min(4, n) :] for i, n in enumerate(lengths)]
    assert len(set(ids)) == len(ids)
    cfg = dict(max_num_reqs=16, max_model_len=64, block_sizes=(16,))
    t, loop = RequestTable(**cfg), LoopRequestTable(**cfg)

    def both(so):
        t.apply(so)
        loop.apply(pickle.loads(pickle.dumps(so)))
        assert_tables_agree(t, loop)

    def add(rids, first_block):
        return SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(r, [1, 2], SamplingParams(8), ([first_block + k],), 0) for k, r in enumerate(rids)
            ]
        )

    both(add(ids, 0))
    n = len(ids)
    for step in range(4):
        order = ids if step % 2 == 0 else ids[::-1]
        cached = CachedRequestData(list(order), set(), [[]] * n, [None] * n, [2 + step] * n, [0] * n)
        so = SchedulerOutput(scheduled_cached_reqs=cached)
        both(pickle.loads(pickle.dumps(so)) if step == 3 else so)  # fresh objects: found by bytes
    assert [t.index.req_id(int(r)) for r in t.rows(ids)] == ids
    both(SchedulerOutput(finished_req_ids=set(ids[::2])))
    both(add(ids[::2], 20))
    assert [t.index.req_id(int(r)) for r in t.rows(ids)] == ids


def test_quiet_interpreter_exit():
    """Tables held as module globals (with owned id references) at exit."""
    code = (
        "import mtpstate\n"
        "from mtpstate.tools.workloads import steady_decode\n"
        "setup, timed = steady_decode(64, steps=3)\n"
        "T = mtpstate.RequestTable(max_num_reqs=64, max_model_len=16384)\n"
        "for so in setup + timed: T.apply(so)\n"
    )
    if _has_torch():  # a mirrored table too
        code += (
            "U = mtpstate.RequestTable(max_num_reqs=64, max_model_len=16384, device='cpu')\n"
            "for so in setup + timed: U.apply(so)\n"
        )
    p = _run(["-c", code])
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == "", p.stderr


JUNK = dict(
    junk=st.lists(
        st.one_of(
            st.none(),
            st.integers(-(2**70), 2**70),
            st.text(max_size=6),
            st.booleans(),
            st.floats(allow_nan=True),
            st.lists(st.integers(-5, 2**40), max_size=3),
        ),
        min_size=1,
        max_size=4,
    ),
    attr=st.sampled_from(["req_ids", "num_computed_tokens", "new_block_ids"]),
)


@pytest.mark.slow
@settings(max_examples=3000)
@given(**JUNK)
def test_random_junk_long_run(junk, attr):
    """The same property, 3000 examples (make test-slow)."""
    test_random_junk_in_cached_lists.hypothesis.inner_test(junk, attr)


@settings(max_examples=40)
@given(**JUNK)
def test_random_junk_in_cached_lists(junk, attr):
    """Random junk in place of the cached lists' items: rejected with a
    StateError and nothing changed, or (where it happens to be valid)
    applied like the oracle. In-process: these never reach a dereference of
    anything but a checked type."""
    from helpers import assert_same_snapshot, assert_tables_agree, table_snapshot
    from robust_cases import World

    w = World()
    p = w.plan(False)
    so = w.build(p)
    c = so.scheduled_cached_reqs
    lst = getattr(c, attr)
    for i, x in enumerate(junk[: len(lst)]):
        lst[i] = x
    before = table_snapshot(w.t)
    try:
        w.t.apply(so)
    except StateError:
        assert_same_snapshot(before, table_snapshot(w.t))
    else:
        w.loop.apply(so)
        assert_tables_agree(w.t, w.loop)


def test_a_kernel_without_a_cpython_wrapper_refuses_a_call_from_python():
    """A kernel that only other kernels call has no CPython wrapper: called
    from Python it raises a TypeError naming it (in a subprocess: without
    the refusal the call jumps into nothing and kills the process), while
    the entry kernels that call it still run."""
    code = (
        "from mtpstate._kernels.pyobjects import _int_of\n"
        "from mtpstate._kernels import jit\n"
        "assert '_int_of' not in jit.ENTRY_KERNELS\n"
        "try:\n"
        "    _int_of(id(1), tuple(range(10)))\n"
        "except TypeError as e:\n"
        "    print('refused:', e)\n"
        "import mtpstate\n"
        "from mtpstate.tools.sim import Simulator\n"
        "t = mtpstate.RequestTable(8, 256, decode_query_len=3)\n"
        "for so in Simulator(max_num_reqs=8, max_model_len=256, num_spec=2, seed=0).run(30):\n"
        "    t.apply(so)\n"
        "print('live', len(t) > 0)\n"
    )
    p = _run(["-c", code])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "refused: mtpstate: mtpstate._kernels.pyobjects._int_of is a kernel that only other kernels call" in p.stdout
    assert "live True" in p.stdout
