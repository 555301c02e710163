"""The mirror's asynchronous ordering, on a model of a GPU (``DeferredOps``):
copies and scatters queued on streams and run later, in any legal order,
reading their source when they run; events that complete only when the work
before them has run; streams held back at random.

The invariant: work queued on the consumer's (model's) stream at any moment
sees the host state of that moment. It needs all three orderings of a step:
a staging slot (and a row-upload buffer) refilled only after the event of
its last copy (a host wait), the copy stream after the consumer's work
already queued (which may still read old values), and the consumer's later
work after the copy. Each test also runs with one of them removed and must
then find disagreements: the checks can fail.
"""

import random

import numpy as np
import pytest
from helpers import EngineSeeds, apply_through_arrays, engine_mirror_options

torch = pytest.importorskip("torch", reason="the device mirror needs torch")

from mtpstate import RequestTable  # noqa: E402
from mtpstate.devices import DeferredOps  # noqa: E402
from mtpstate.tools.sim import Simulator  # noqa: E402

FIELDS = ("num_computed_tokens", "num_computed_prefill_tokens", "prefill_len", "prompt_len", "max_seq_len")


class NoHostWait(DeferredOps):
    """The mutation: a slot or buffer is refilled without waiting for the
    event of the copy that reads it."""

    def host_wait(self, event):
        pass


class CopyNotAfterConsumer(DeferredOps):
    """The mutation: the copy stream does not wait for the consumer's work
    already queued."""

    def wait_stream(self, waiter, waitee):
        if waiter is self.default:
            super().wait_stream(waiter, waitee)


class ConsumerNotAfterCopy(DeferredOps):
    """The mutation: the consumer's later work does not wait for the copy."""

    def wait_stream(self, waiter, waitee):
        if waiter is not self.default:
            super().wait_stream(waiter, waitee)


def _sim(R, L, seed):
    return Simulator(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=(16, 32),
        num_spec=3,
        accept=0.6,
        preempt_prob=0.2,
        abort_prob=0.1,
        prompt_len=(1, 120),
        output_len=(10, 200),
        seed=seed,
    )


class Checker:
    """Consumer-side reads queued on the deferred device, each with the host
    state at the moment it was queued; compared once everything has run."""

    def __init__(self, ops, table, target=None, seeds=None):
        self.ops, self.t, self.target, self.seeds = ops, table, target, seeds
        self.reads = []  # [expected, got (filled when the read runs)]

    def _host(self):
        t = self.t
        d = t.device_tensors
        out = {f: getattr(t, f).copy() for f in FIELDS if getattr(d, f) is not None}
        out["num_blocks"] = t.num_blocks.copy()
        out.update({f"bt{g}": b.copy() for g, b in enumerate(t.block_tables)})
        if t.token_ids is not None and t._mirror.token_ids_on_device:
            out["token_ids"] = t.token_ids.copy()
        if self.seeds is not None:
            out["seeded"] = {row: (list(tok), n) for row, (tok, n) in self.seeds.rows.items()}
        return out

    def _device(self):
        t = self.t
        d = t.device_tensors
        out = {f: getattr(d, f).numpy().copy() for f in FIELDS if getattr(d, f) is not None}
        out["num_blocks"] = d.num_blocks.numpy().copy()
        out.update({f"bt{g}": b.numpy().copy() for g, b in enumerate(d.block_tables)})
        if t._mirror.token_ids_on_device:
            out["token_ids"] = d.token_ids.numpy().copy()
        if self.target is not None:
            out["target"] = self.target.numpy().copy()
            out["total_len"] = d.total_len.numpy().copy()
            out["engine_nct"] = d.engine_num_computed_tokens.numpy().copy()
        return out

    def read(self, stream=None):
        """A kernel on the consumer's stream reading the mirrored tensors."""
        entry = [self._host(), None]
        self.reads.append(entry)

        def run():
            entry[1] = self._device()

        self.ops.enqueue(run, stream or self.ops.default)

    def disagreements(self) -> int:
        bad = 0
        for want, got in self.reads:
            assert got is not None, "a queued read never ran"
            ok = all(np.array_equal(want[k], got[k]) for k in want if k != "seeded")
            for row, (tokens, n_computed) in want.get("seeded", {}).items():
                ok &= got["target"][row, : len(tokens)].tolist() == tokens
                ok &= int(got["total_len"][row]) == len(tokens) and int(got["engine_nct"][row]) == n_computed
            bad += not ok
        return bad


def _drive(ops, table, checker, sim, steps, seed, seeds=None, rows=None):
    """Apply ``steps`` steps with the consumer and the copy stream held back
    and released at random, random legal progress in between, a consumer read
    queued before and after every step. ``rows``: also upload each step's
    batch rows through a row ring and read them back on the consumer."""
    rng = random.Random(seed)
    copy_stream = table._mirror._stream
    uploads = []
    for so in sim.run(steps):
        checker.read()  # the previous step's kernels, possibly still pending
        for s in (ops.default, copy_stream):
            if rng.random() < 0.4:
                ops.hold(s)
            elif rng.random() < 0.5:
                ops.release(s)
        res = table.apply(so)
        if seeds is not None:
            seeds.record(so, res)
        checker.read()  # the next step's kernels: must see this step's state
        if rows is not None:
            want = res.cached_rows.astype(np.int64).copy()
            out = table.upload_rows(want, rows)
            entry = [want, None]
            uploads.append(entry)
            ops.enqueue(lambda out=out, entry=entry: entry.__setitem__(1, out.numpy().copy()))
        ops.run_some(rng.randrange(0, 8))
    for s in ops.streams:
        ops.release(s)
    ops.synchronize()
    bad = checker.disagreements()
    bad += sum(not np.array_equal(w, g) for w, g in uploads)
    return bad


def _plain(ops, depth, R=48, L=512):
    t = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=(16, 32),
        device="cpu",
        mirror_options={"ring_depth": depth, "ops": ops},
    )
    return t, Checker(ops, t)


@pytest.mark.parametrize("depth", [2, 3])
def test_ring_reuse_on_deferred_device(depth):
    """Every mirrored tensor, read on the consumer's stream before and after
    every step, equals the host state of that moment; the batch rows
    uploaded through the rows ring too."""
    ops = DeferredOps(torch, seed=depth)
    t, checker = _plain(ops, depth)
    assert _drive(ops, t, checker, _sim(48, 512, depth), 300, depth, rows="idx_mapping") == 0
    assert ops.ops_run > 1000  # the device really ran the queued work


@pytest.mark.parametrize("mutant", [NoHostWait, CopyNotAfterConsumer, ConsumerNotAfterCopy], ids=lambda c: c.__name__)
def test_ordering_checks_fail_without_each_wait(mutant):
    """The same run with one ordering removed finds disagreements."""
    ops = mutant(torch, seed=1)
    t, checker = _plain(ops, 2)
    assert _drive(ops, t, checker, _sim(48, 512, 1), 300, 1, rows="idx_mapping") > 0


def test_held_back_consumer_still_reads_old_values():
    """The consumer's stream is held while a read of the previous state is
    still queued: the step's copy (which would overwrite that state) must
    not run before it, however long the consumer is held and however much
    the device could run meanwhile."""
    for ops_cls, expect_ok in ((DeferredOps, True), (CopyNotAfterConsumer, False)):
        ops = ops_cls(torch, seed=0)
        t, checker = _plain(ops, 3)
        sim = _sim(48, 512, 0)
        steps = iter(sim.run(40))
        for _ in range(5):  # some state to read
            t.apply(next(steps))
        ops.synchronize()
        bad = 0
        for so in steps:
            checker.read()
            ops.hold(ops.default)
            t.apply(so)
            ops.run_some()  # everything else the device can run, the consumer held
            ops.release(ops.default)
            ops.synchronize()
            bad += checker.disagreements()
            checker.reads.clear()
        assert (bad == 0) == expect_ok, (ops_cls.__name__, bad)


@pytest.mark.parametrize("depth", [2, 3])
def test_engine_targets_on_deferred_device(depth):
    """The vLLM adapter's configuration (three fields, engine lengths seeded
    per added row, new requests' token ids scattered into an engine tensor)
    under random holds: every consumer read sees exactly what each row's
    last add seeded."""
    # with the consumer not waiting for the copy, its reads see stale rows
    assert _engine_run(DeferredOps, depth) == 0
    assert _engine_run(ConsumerNotAfterCopy, depth) > 0


def _engine_run(ops_cls, depth, R=48, L=512) -> int:
    ops = ops_cls(torch, seed=10 + depth)
    target = torch.full((R, L), -1, dtype=torch.int32)
    t = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=(16, 32),
        device="cpu",
        mirror_options=engine_mirror_options(target, ring_depth=depth, ops=ops),
    )
    seeds = EngineSeeds()
    checker = Checker(ops, t, target=target, seeds=seeds)
    return _drive(ops, t, checker, _sim(R, L, depth), 200, depth, seeds=seeds)


def test_host_token_ids_refused_on_an_asynchronous_device():
    """token_ids_on_device=False would have the host write new requests'
    tokens into memory that queued device work may still read."""
    with pytest.raises(ValueError, match="token_ids_target"):
        RequestTable(
            max_num_reqs=4,
            max_model_len=32,
            device="cpu",
            mirror_options={"token_ids_on_device": False, "ops": DeferredOps(torch)},
        )


def test_array_entry_and_same_step_duplicates_on_deferred_device():
    """The other staging paths under a held-back copy stream: steps that
    stage an element twice (a row added and updated by the same step: the
    last write must win on the device), and the array entry point
    (``finish`` / ``add`` / ``update_arrays``, shipped by ``stage_arrays``)."""
    from test_table import SAME_STEP_TABLE, same_step_steps

    from mtpstate._kernels import slots as T

    ops = DeferredOps(torch, seed=5)
    t = RequestTable(**SAME_STEP_TABLE, device="cpu", mirror_options={"ops": ops})
    checker = Checker(ops, t)
    setup, steps = same_step_steps()
    steps = setup + steps
    ops.hold(t._mirror._stream)
    dups = 0
    for so in steps:
        checker.read()
        t.apply(so)
        dups += int(t._cv[T.TB_STG_DUPS])
        checker.read()
    assert dups > 0  # the duplicate path ran
    cfg = dict(max_num_reqs=8, max_model_len=128, block_sizes=(16,))
    ops2 = DeferredOps(torch, seed=6)
    t2 = RequestTable(**cfg, device="cpu", mirror_options={"ops": ops2})
    checker2 = Checker(ops2, t2)
    rng = random.Random(6)
    sim = Simulator(**cfg, num_spec=2, seed=4, prompt_len=(1, 50), output_len=(2, 30))
    for so in sim.run(40):
        (ops2.hold if rng.random() < 0.5 else ops2.release)(t2._mirror._stream)
        checker2.read()
        apply_through_arrays(t2, so)
        checker2.read()
        ops2.run_some(rng.randrange(0, 5))
    for o in (ops, ops2):
        for s in o.streams:
            o.release(s)
        o.synchronize()
    assert checker.disagreements() == 0 and checker2.disagreements() == 0
