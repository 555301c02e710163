"""The mirror's asynchronous ordering, on a model of a GPU (``DeferredOps``):
replays, copies and scatters queued on streams and run later, in any legal
order, reading their source (the pinned slot) when they run; events that
complete only when the work before them has run; streams held back at
random; the consumer moving between streams.

The invariant: work queued on the consumer's (model's) stream at any moment
sees the host state of that moment. A step's device work is one replay on
the consumer's stream (or the same work issued eagerly there), so stream
order gives most of it; what the mirror must add: a staging slot refilled
only after the event recorded after its replay (a host wait), the work on
the consumer's stream and no other, and, when the consumer moves to another
stream, the new one waiting for the old. Each test also runs with one of
them removed and must then find disagreements: the checks can fail.
"""

import random

import numpy as np
import pytest
from helpers import EngineSeeds, apply_through_arrays, engine_mirror_options

torch = pytest.importorskip("torch", reason="the device mirror needs torch")

from mtpstate import MirrorFaultError, RequestTable  # noqa: E402
from mtpstate.devices import DeferredOps  # noqa: E402
from mtpstate.tools.sim import Simulator  # noqa: E402

FIELDS = ("num_computed_tokens", "num_computed_prefill_tokens", "prefill_len", "prompt_len", "max_seq_len")
DQL = 4  # decode_query_len of the simulated steps (3 drafts)


class NoHostWait(DeferredOps):
    """The mutation: a slot or buffer is refilled without waiting for the
    event of the work that reads it."""

    def host_wait(self, event):
        pass


class OffConsumerStream(DeferredOps):
    """The mutation: the step's device work runs on a stream of its own,
    which nothing orders with the consumer's."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.own = self.new_stream()

    def _own(self, issue, *args):
        with self.on_stream(self.own):
            issue(*args)

    def replay(self, graph):
        self._own(super().replay, graph)

    def copy(self, dst, src):
        self._own(super().copy, dst, src)

    def scatter(self, target, positions, values):
        self._own(super().scatter, target, positions, values)


class NoStreamFollow(DeferredOps):
    """The mutation: a consumer that moved to another stream does not wait
    for the previous one."""

    def wait_stream(self, waiter, waitee):
        pass


MUTANTS = [NoHostWait, OffConsumerStream, NoStreamFollow]


def _sim(R, L, seed):
    return Simulator(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=(16, 32),
        num_spec=DQL - 1,
        accept=0.6,
        preempt_prob=0.2,
        abort_prob=0.1,
        prompt_len=(1, 120),
        output_len=(10, 200),
        seed=seed,
    )


class Checker:
    """Consumer-side reads queued on the deferred device, each with the host
    state at the moment it was queued; compared once everything has run.
    ``drafts``: a tensor the mirror zeroes for new rows, which the consumer
    (a speculator) fills with the step number after every step."""

    def __init__(self, ops, table, target=None, seeds=None, drafts=None):
        self.ops, self.t, self.target, self.seeds, self.drafts = ops, table, target, seeds, drafts
        self.reads = []  # [expected, got (filled when the read runs)]
        self.step = 0
        self.new_rows = []

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
        if self.drafts is not None:
            want = np.full(self.drafts.shape, self.step, np.int64)
            want[self.new_rows] = 0
            out["drafts"] = want
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
        if self.drafts is not None:
            out["drafts"] = self.drafts.numpy().copy()
        return out

    def read(self):
        """A kernel on the consumer's current stream reading the mirrored tensors."""
        entry = [self._host(), None]
        self.reads.append(entry)

        def run():
            entry[1] = self._device()

        self.ops.enqueue(run)

    def read_idx(self, res):
        """prepare_inputs reading the step's idx_mapping on the device."""
        want, out = res.batch.idx_mapping_np.copy(), self.t.device_idx_mapping()
        entry = [{"idx": want}, None]
        self.reads.append(entry)
        self.ops.enqueue(lambda: entry.__setitem__(1, {"idx": out.numpy().copy()}))

    def applied(self, res, also_zeroed=()):
        """After a step: the rows it added (their drafts are 0 until the
        speculator's next fill)."""
        self.new_rows = [*also_zeroed, *res.new_rows.tolist()]

    def speculate(self):
        """The speculator filling every row's drafts (queued after the
        step's reads)."""
        if self.drafts is not None:
            step, drafts = self.step + 1, self.drafts
            self.ops.enqueue(lambda: drafts.fill_(step))
            self.step, self.new_rows = step, []

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


def _drive(ops, table, checker, sim, steps, seed, seeds=None, switch=0.0):
    """Apply ``steps`` steps with streams held back and released at random,
    random legal progress in between, a consumer read queued before and
    after every step (and of the step's idx_mapping when shipped), the
    consumer moving to another stream with probability ``switch``."""
    rng = random.Random(seed)
    side = ops.new_stream()
    consumer = ops.default
    for so in sim.run(steps):
        moved = rng.random() < switch
        if moved:
            consumer = side if consumer is ops.default else ops.default
        with ops.on_stream(consumer):
            if not moved:  # (after a move, the previous step's kernels ran on the other stream)
                checker.read()  # the previous step's kernels, possibly still pending
            for s in ops.streams:
                if rng.random() < 0.4:
                    ops.hold(s)
                elif rng.random() < 0.5:
                    ops.release(s)
            res = table.apply(so)
            if seeds is not None:
                seeds.record(so, res)
            checker.applied(res)
            checker.read()  # the next step's kernels: must see this step's state
            if table._mirror._idx_on and res.batch is not None:
                checker.read_idx(res)
            checker.speculate()
        ops.run_some(rng.randrange(0, 8))
    return _finish(ops, checker)


def _finish(ops, checker) -> int:
    """Release every stream, run everything queued, count the disagreements."""
    for s in ops.streams:
        ops.release(s)
    ops.synchronize()
    return checker.disagreements()


def _plain(ops, depth, R=48, L=512):
    t = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=(16, 32),
        device="cpu",
        mirror_options={"ring_depth": depth, "ops": ops},
    )
    return t, Checker(ops, t)


def _engine(ops, depth, R=48, L=512, **options):
    """The vLLM adapter's configuration: three fields, engine lengths, new
    token ids into an engine tensor, the batch's idx_mapping, new rows'
    drafts zeroed; all in the step's one replay."""
    target = torch.full((R, L), -1, dtype=torch.int32)
    drafts = torch.zeros((R, DQL - 1), dtype=torch.int64)
    t = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=(16, 32),
        device="cpu",
        decode_query_len=DQL,
        mirror_options=engine_mirror_options(
            target, ring_depth=depth, ops=ops, idx_mapping=True, zero_rows_on_add=(drafts,), **options
        ),
    )
    seeds = EngineSeeds()
    return t, Checker(ops, t, target=target, seeds=seeds, drafts=drafts), seeds


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("depth", [2, 3])
def test_ring_reuse_on_deferred_device(depth, graphs):
    """Every mirrored tensor, read on the consumer's stream before and after
    every step, equals the host state of that moment, the consumer moving
    between two streams now and then."""
    ops = DeferredOps(torch, seed=depth, graphs=graphs)
    t, checker = _plain(ops, depth)
    assert t._mirror.path == ("graph" if graphs else "eager")
    assert _drive(ops, t, checker, _sim(48, 512, depth), 300, depth, switch=0.1) == 0
    assert ops.ops_run > 300  # the device really ran the queued work


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda c: c.__name__)
def test_ordering_checks_fail_without_each_guard(mutant, graphs):
    """The same run with one guard removed finds disagreements."""
    ops = mutant(torch, seed=1, graphs=graphs)
    t, checker = _plain(ops, 2)
    assert _drive(ops, t, checker, _sim(48, 512, 1), 300, 1, switch=0.3) > 0


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_held_back_consumer_still_reads_old_values(graphs):
    """The consumer's stream is held while a read of the previous state is
    still queued: the step's device work (which overwrites that state) must
    not run before it, however long the consumer is held and however much
    the device could run meanwhile."""
    for ops_cls, expect_ok in ((DeferredOps, True), (OffConsumerStream, False)):
        ops = ops_cls(torch, seed=0, graphs=graphs)
        t, checker = _plain(ops, 3)
        steps = iter(_sim(48, 512, 0).run(40))
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


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("depth", [2, 3])
def test_engine_targets_on_deferred_device(depth, graphs):
    """The vLLM adapter's configuration under random holds and stream moves:
    every consumer read sees exactly what each row's last add seeded, the
    step's idx_mapping, and the new rows' drafts zeroed after the
    speculator's last fill; with any guard removed, it does not."""
    assert _engine_run(DeferredOps, depth, graphs) == 0
    for mutant in MUTANTS:
        assert _engine_run(mutant, depth, graphs) > 0, mutant.__name__


def _engine_run(ops_cls, depth, graphs) -> int:
    ops = ops_cls(torch, seed=10 + depth, graphs=graphs)
    t, checker, seeds = _engine(ops, depth)
    try:
        return _drive(ops, t, checker, _sim(48, 512, depth), 200, depth, seeds=seeds, switch=0.2)
    except (IndexError, MirrorFaultError) as e:
        # a mutant's scatter read another step's positions (a token position
        # into the flat tensor): on a GPU, a device-side assert, which the
        # mirror reports as a lost device when it next waits
        if ops_cls is DeferredOps or not _out_of_bounds(e):
            raise
        return 1


def _out_of_bounds(e: BaseException | None) -> bool:
    # (the mirror's MirrorFaultError names the device error as its cause, at
    # the wait that met it and at every later call)
    while e is not None and not isinstance(e, IndexError):
        e = e.__cause__
    return e is not None


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_token_overflow_chunks_on_deferred_device(graphs):
    """Token areas far smaller than a step's token ids (8 per slot and per
    chunk): the rest go through the overflow ring, a chunk at a time, under
    random holds and stream moves; every read still agrees, nothing is
    captured after construction; with any guard removed, it does not."""
    for ops_cls in (DeferredOps, *MUTANTS):
        ops = ops_cls(torch, seed=21, graphs=graphs)
        t, checker, seeds = _engine(ops, 2, token_chunk=8)
        captures = ops.issued["capture"]
        try:
            bad = _drive(ops, t, checker, _sim(48, 512, 21), 120, 21, seeds=seeds, switch=0.1)
        except (IndexError, MirrorFaultError) as e:  # (a mutant's scatter read another step's positions)
            assert ops_cls is not DeferredOps and _out_of_bounds(e)
            bad = 1
        assert (bad == 0) == (ops_cls is DeferredOps), (ops_cls.__name__, bad)
        if ops_cls is DeferredOps:
            assert ops.issued["capture"] == captures and t._mirror.path == ("graph" if graphs else "eager")
            assert ops.issued["replay" if graphs else "scatter"] > 2 * 120  # (the chunks shipped)


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


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_array_entry_and_same_step_duplicates_on_deferred_device(graphs):
    """The other staging paths under a held-back consumer: steps that stage
    an element twice (a row added and updated by the same step: the last
    write must win on the device), and the array entry point (``finish`` /
    ``add`` / ``update_arrays``, shipped by ``stage_arrays``); with the host
    wait removed, or the work off the consumer's stream, they disagree."""
    dups, bad = _same_step_run(DeferredOps, graphs)
    assert dups > 0 and bad == 0  # (the duplicate path ran)
    assert _array_entry_run(DeferredOps, graphs) == 0
    for mutant in (NoHostWait, OffConsumerStream):
        assert _same_step_run(mutant, graphs)[1] + _array_entry_run(mutant, graphs) > 0, mutant.__name__


def _same_step_run(ops_cls, graphs):
    from test_table import SAME_STEP_TABLE, same_step_steps

    from mtpstate._kernels import slots as T

    ops = ops_cls(torch, seed=5, graphs=graphs)
    t = RequestTable(**SAME_STEP_TABLE, device="cpu", mirror_options={"ops": ops})
    checker = Checker(ops, t)
    setup, steps = same_step_steps()
    dups = 0
    for so in setup + steps:
        (ops.hold if len(checker.reads) % 3 else ops.release)(ops.default)
        checker.read()
        t.apply(so)
        dups += int(t._cv[T.TB_STG_DUPS])
        checker.read()
    return dups, _finish(ops, checker)


def _array_entry_run(ops_cls, graphs) -> int:
    cfg = dict(max_num_reqs=8, max_model_len=128, block_sizes=(16,))
    ops = ops_cls(torch, seed=6, graphs=graphs)
    t = RequestTable(**cfg, device="cpu", mirror_options={"ops": ops, "ring_depth": 2})
    checker = Checker(ops, t)
    rng = random.Random(6)
    sim = Simulator(**cfg, num_spec=2, seed=4, prompt_len=(1, 50), output_len=(2, 30))
    for so in sim.run(40):
        for s in ops.streams:
            (ops.hold if rng.random() < 0.5 else ops.release)(s)
        checker.read()
        apply_through_arrays(t, so)
        checker.read()
        ops.run_some(rng.randrange(0, 5))
    return _finish(ops, checker)


# ----------------------------------------------------------------------------
# what a step issues, and what a failure of it leaves


def _steady_and_busy(n, steps=6):
    """(setup, quiet steps, steps that add and finish requests) for N running."""
    from mtpstate.tools.workloads import mixed, steady_decode

    setup, quiet = steady_decode(n, steps=steps, num_spec=DQL - 1)
    for so in quiet:  # with a batch: every request decodes (dql tokens, 3 drafts)
        ids = so.scheduled_cached_reqs.req_ids
        so.num_scheduled_tokens = dict.fromkeys(ids, DQL)
        so.scheduled_spec_decode_tokens = {r: [1, 2, 3] for r in ids}
        so.total_num_scheduled_tokens = DQL * len(ids)
    msetup, busy = mixed(n, steps=steps)
    return setup, quiet, msetup, busy


@pytest.mark.parametrize("n", [1, 1024])
def test_device_operations_per_step(n):
    """The design's count, in the adapter's configuration (engine lengths,
    token target, idx_mapping, drafts zeroed): every step issues one replay
    and one event record, whatever arrives, at N = 1 and N = 1024."""
    from mtpstate.tools.workloads import BLOCK_SIZE, MAX_MODEL_LEN

    setup, quiet, msetup, busy = _steady_and_busy(n)
    for steps_setup, steps in ((setup, quiet), (msetup, busy)):
        ops = DeferredOps(torch, graphs=True)
        R = n if steps is quiet else max(n, 64)
        target = torch.zeros((R, MAX_MODEL_LEN), dtype=torch.int32)
        drafts = torch.zeros((R, DQL - 1), dtype=torch.int64)
        t = RequestTable(
            max_num_reqs=R,
            max_model_len=MAX_MODEL_LEN,
            block_sizes=[BLOCK_SIZE],
            device="cpu",
            decode_query_len=DQL,
            mirror_options=engine_mirror_options(target, ops=ops, idx_mapping=True, zero_rows_on_add=(drafts,)),
        )
        assert t._mirror.path == "graph"
        for so in steps_setup:
            t.apply(so)
        arrivals = 0
        for so in steps:
            before = dict(ops.issued)
            res = t.apply(so)
            issued = {k: v - before.get(k, 0) for k, v in ops.issued.items() if v != before.get(k, 0)}
            arrivals += len(res.new_rows) > 0
            assert issued == {"replay": 1, "record": 1}, (n, issued)
            ops.synchronize()
        assert arrivals == (0 if steps is quiet else len(steps)) or steps is not quiet


def _faulty_run(graphs: bool, fail_offset: int, fault=None):
    """The engine configuration on the deferred device; at every 5th step the
    ``fail_offset``-th device operation of that step raises (``fault``: the
    exception class, default the model's own). The engine goes on with the
    next step (the one the fault hit was applied on the host). Returns
    (faults seen, disagreements of the reads after every successful step)."""
    ops = DeferredOps(torch, seed=3, graphs=graphs)
    if fault is not None:
        ops.fault = fault
    t, checker, seeds = _engine(ops, 2)
    faults, unzeroed = 0, []
    for k, so in enumerate(_sim(48, 512, 7).run(60)):
        if k % 5 == 4:
            ops.fail_at = sum(ops.issued.values()) + fail_offset
        records = ops.issued["record"]
        try:
            res = t.apply(so)
        except (MirrorFaultError, KeyboardInterrupt) as e:
            assert fault is not None or "applied to the host arrays" in str(e)
            # stale unless everything was queued (only the slot's event record failed)
            assert t._mirror.stale == getattr(e, "stale", True), str(e)
            assert t._mirror.stale == (ops.issued["record"] == records), str(e)
            faults += 1
            seeds.record(so, t._result)  # (its seeds and drafts: shipped by the resync)
            unzeroed += t._result.new_rows.tolist()
            continue
        finally:
            ops.fail_at = None
        seeds.record(so, res)
        checker.applied(res, also_zeroed=unzeroed)
        unzeroed = []
        checker.read()
        checker.speculate()
        ops.run_some(3)
    t.synchronize()
    checker.read()
    ops.synchronize()
    return faults, checker.disagreements()


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_device_faults_leave_no_silent_divergence(graphs):
    """A failure at each device operation of a step (the step's replay and
    event record; on the eager path each copy, scatter and fill too): the
    step raises MirrorFaultError (the host was applied), the mirror is
    stale unless all of the step's work was queued, and after the next
    successful step every device tensor equals the host (and the engine's
    tensors what each row's last add seeded)."""
    n_ops = 2 if graphs else 8
    for offset in range(n_ops):
        faults, bad = _faulty_run(graphs, offset)
        assert bad == 0, (offset, bad)
        assert faults > 0 or offset >= 2, offset  # replay and record: every step issues them


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_interrupted_device_work_is_resynchronized(graphs):
    """A KeyboardInterrupt while a step's device work is issued propagates
    as it is; the next call resynchronizes the mirror all the same."""
    faults, bad = _faulty_run(graphs, 0, KeyboardInterrupt)
    assert faults > 0 and bad == 0


def test_resync_failure_changes_nothing_and_retries():
    """The resynchronization failing too: the call raises MirrorFaultError
    before the step (nothing applied); a later call succeeds."""
    ops = DeferredOps(torch, seed=4)
    t, checker, seeds = _engine(ops, 2)
    steps = list(_sim(48, 512, 8).run(12))
    for so in steps[:5]:
        seeds.record(so, t.apply(so))
    ops.fail_at = sum(ops.issued.values())
    with pytest.raises(MirrorFaultError):
        seeds.record(steps[5], t.apply(steps[5]))
    seeds.record(steps[5], t._result)
    ops.fail_at = sum(ops.issued.values()) + 1  # (the resync's first device operation after its wait)
    live = len(t)
    with pytest.raises(MirrorFaultError, match="resynchronizing"):
        t.apply(steps[6])
    assert len(t) == live and t._mirror.stale  # nothing applied
    ops.fail_at = None
    for so in steps[6:]:
        seeds.record(so, t.apply(so))
    assert not t._mirror.stale
    ops.synchronize()
    seeds.check(t, checker.target)
    for name in ("prefill_len", "prompt_len", "num_blocks"):
        np.testing.assert_array_equal(getattr(t.device_tensors, name).numpy(), getattr(t, name))


@pytest.mark.parametrize("presize", [False, True], ids=["lazy-views", "presized-views"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_batch_inputs_shipped_with_the_step(graphs, presize):
    """query_start_loc (into the engine's tensor) and cu_num_logits ship in
    the step's own device work, under random holds and stream moves: each
    consumer read queued after a step sees that step's host arrays; nothing
    extra is issued; without the host wait, reads disagree."""
    for ops_cls in (DeferredOps, NoHostWait):
        ops = ops_cls(torch, seed=31, graphs=graphs)
        rng = random.Random(31)
        qsl = torch.zeros(49, dtype=torch.int32)
        t = RequestTable(
            max_num_reqs=48,
            max_model_len=512,
            block_sizes=(16, 32),
            device="cpu",
            decode_query_len=DQL,
            mirror_options={"ops": ops, "idx_mapping": True, "query_start_loc_target": qsl, "ring_depth": 2},
        )
        if presize:  # (what the vLLM adapter does: every size's views made up front)
            t._mirror.presize_views()
            t._batch.presize_views()
        reads = []
        issued = None
        expanded = 0
        for so in _sim(48, 512, 31).run(120):
            before = dict(ops.issued)
            b = t.apply(so).batch
            if issued is None and graphs:
                issued = {k: v - before.get(k, 0) for k, v in ops.issued.items() if v != before.get(k, 0)}
            exp = b.expanded_idx_mapping_np is not None
            want = (b.query_start_loc_np.copy(), b.cu_num_logits_np.copy())
            if exp:
                want += (b.expanded_idx_mapping_np.copy(), b.expanded_local_pos_np.copy())
                expanded += 1
            q, cu, _ = t.device_batch_inputs()
            dev = (q, cu, *(t.device_expanded_logits() or ()))
            assert len(dev) == len(want)
            got = []
            ops.enqueue(lambda dev=dev, got=got: got.append([x.clone() for x in dev]))
            reads.append((want, got))
            if rng.random() < 0.3:
                ops.hold(ops.default)
            ops.run_some()
            ops.release(ops.default)
        ops.synchronize()
        bad = sum(1 for want, got in reads if not all(np.array_equal(g.numpy(), w) for g, w in zip(got[0], want)))
        assert (bad == 0) == (ops_cls is DeferredOps), (ops_cls.__name__, bad)
        assert expanded > len(reads) // 2, expanded  # (most steps draft)
        if graphs and ops_cls is DeferredOps:
            assert issued == {"replay": 1, "record": 1}, issued


def test_batch_inputs_target_checked():
    kw = dict(max_num_reqs=8, max_model_len=64, device="cpu", decode_query_len=2)
    for bad in (torch.zeros(8, dtype=torch.int32), torch.zeros(9, dtype=torch.int64)):
        with pytest.raises(ValueError, match="query_start_loc_target"):
            RequestTable(**kw, mirror_options={"idx_mapping": True, "query_start_loc_target": bad})
    with pytest.raises(ValueError, match="needs idx_mapping"):
        RequestTable(**kw, mirror_options={"query_start_loc_target": torch.zeros(9, dtype=torch.int32)})
