"""The device mirror while an engine serves, on the deferred model of a GPU:
vLLM's sizes with nothing grown or captured after construction, an engine's
graph capture left intact, faults before and after a step's work was
queued, a device lost for good, the lifetime of the buffers, targets on
another device, steps larger than the staging. Each guard is also removed
once (a mutant), and the check must then fail."""

import gc

import numpy as np
import pytest
from helpers import ENGINE_FIELDS, EngineSeeds, engine_mirror_options

torch = pytest.importorskip("torch", reason="the device mirror needs torch")

from mtpstate import CapacityError, MirrorFaultError, RequestTable, StateError  # noqa: E402
from mtpstate.devices import DeferredOps  # noqa: E402
from mtpstate.mirror import step_capacity  # noqa: E402
from mtpstate.tools.sim import Simulator  # noqa: E402

DQL = 4  # decode_query_len (3 drafts)


def _engine(ops, R=48, L=512, block_sizes=(16, 32), device="cpu", target=None, **options):
    """The vLLM adapter's configuration (see test_mirror_ordering._engine):
    (table, its token target, the drafts it zeroes on add)."""
    target = torch.full((R, L), -1, dtype=torch.int32, device=device) if target is None else target
    drafts = torch.zeros((R, DQL - 1), dtype=torch.int64, device=device)
    t = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=block_sizes,
        device=device,
        decode_query_len=DQL,
        mirror_options=engine_mirror_options(target, ops=ops, idx_mapping=True, zero_rows_on_add=(drafts,), **options),
    )
    return t, target, drafts


def _sim(R=48, L=512, seed=0, **knobs):
    base = dict(num_spec=DQL - 1, accept=0.6, preempt_prob=0.2, abort_prob=0.1, prompt_len=(1, 120))
    return Simulator(max_num_reqs=R, max_model_len=L, block_sizes=(16, 32), output_len=(10, 200), seed=seed,
                     **{**base, **knobs})  # fmt: skip


def _assert_device_equals_host(t, target, seeds):
    t.synchronize()
    d = t.device_tensors
    for name in ENGINE_FIELDS:
        np.testing.assert_array_equal(getattr(d, name).numpy(), getattr(t, name), err_msg=name)
    for g, bt in enumerate(t.block_tables):
        np.testing.assert_array_equal(d.block_tables[g].numpy(), bt, err_msg=f"block table {g}")
    seeds.check(t, target)


# ----------------------------------------------------------------------------
# vLLM's sizes: nothing grows, nothing is captured while serving


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_vllm_sizes_capture_nothing_while_serving(graphs):
    """R = 1024, L = 32768 in the adapter's configuration (one KV group of
    16-token blocks), prompts of 2k-20k tokens arriving several a step:
    no capture and no allocation after construction, device == host after
    every step (the engine's token tensor included), and the memory the
    mirror holds at most twice what one step can carry."""
    R, L = 1024, 32768
    ops = DeferredOps(torch, seed=1, graphs=graphs)
    t, target, _ = _engine(ops, R, L, block_sizes=(16,))
    built = dict(ops.issued)
    stats = t.transfer_stats()
    allocated = []
    ops.pinned_empty = ops.empty = lambda *a, **k: allocated.append(a)  # any allocation from now on
    sim = Simulator(
        max_num_reqs=R, max_model_len=L, block_sizes=(16,), max_num_batched_tokens=65536, arrivals_per_step=6,
        prompt_len=(2000, 20000), output_len=(2, 12), num_spec=DQL - 1, preempt_prob=0.1, seed=3,
    )  # fmt: skip
    seeds = EngineSeeds()
    arrivals = 0
    for so in sim.run(40):
        res = t.apply(so)
        seeds.record(so, res)
        arrivals += len(res.new_rows)
        _assert_device_equals_host(t, target, seeds)
    assert arrivals > 30
    assert ops.issued["capture"] == built.get("capture", 0) and not allocated
    # one step can carry: every staged element, every token id of R new requests
    carry = 12 * step_capacity(R, 1, [L // 16]) + 12 * R * L
    assert stats["staging_capacity"] == step_capacity(R, 1, [L // 16])
    assert 0 < stats["pinned_bytes"] <= 2 * carry and 0 < stats["device_bytes"] <= 2 * carry
    assert stats["path"] == ("graph" if graphs else "eager")


def test_steps_past_the_staging_are_refused_and_change_nothing():
    """A staging capacity below what a step stages: the step is refused with
    a CapacityError naming the option, and neither the host nor the device
    changes; the array entry point likewise, before it writes."""
    ops = DeferredOps(torch)
    t, target, _ = _engine(ops, staging_capacity=40)
    steps = iter(_sim(seed=2).run(200))
    applied = 0
    for so in steps:
        host = [t._state.copy(), *(b.copy() for b in t.block_tables)]
        t.synchronize()
        dev = [t._mirror._flat.clone(), target.clone()]
        live = len(t)
        try:
            t.apply(so)
            applied += 1
        except CapacityError as e:
            assert "staging_capacity" in str(e) and "nothing was applied" in str(e)
            assert len(t) == live
            for a, b in zip(host, [t._state, *t.block_tables]):
                np.testing.assert_array_equal(a, b)
            t.synchronize()
            assert torch.equal(dev[0], t._mirror._flat) and torch.equal(dev[1], target)
            break
    else:
        pytest.fail("no step exceeded the staging")
    assert applied > 0
    rows = np.flatnonzero(t._index._key_len >= 0)
    assert len(rows) > 0
    t._mirror._cap = 2 * len(rows) - 1  # (two counts a row: one element short)
    before = t._state.copy()
    with pytest.raises(CapacityError, match="staging_capacity"):
        t.update_arrays(rows, np.zeros(len(rows), np.int64) + 1)
    np.testing.assert_array_equal(before, t._state)


# ----------------------------------------------------------------------------
# an engine's graph capture


def test_calls_during_an_engine_capture_are_refused_before_any_device_call():
    """While the current stream is being captured: building a device table,
    apply, update_arrays, upload_rows, synchronize and a pending resync
    raise StateError and issue, allocate, record and wait for nothing (the
    capture stays valid); the same calls work once the capture ends. The
    check fails if the mirror does not ask (a mutant that never sees the
    capture)."""
    ops, refused, calls = _calls_during_capture(blind=False)
    assert refused == calls and ops.capture_violations == []
    ops, refused, calls = _calls_during_capture(blind=True)
    assert refused < calls and ops.capture_violations  # what the guard prevents


def _calls_during_capture(blind: bool):
    ops = DeferredOps(torch, seed=4)
    t, target, _ = _engine(ops)
    steps = iter(_sim(seed=4).run(30))
    for _ in range(5):
        t.apply(next(steps))
    if blind:
        ops.capturing = lambda: False
    issued = dict(ops.issued)
    so = next(steps)
    ops.begin_capture()
    calls = [
        lambda: _engine(ops),
        lambda: t.apply(so),
        lambda: t.update_arrays(np.array([], np.int64), np.array([], np.int64)),
        lambda: t.upload_rows([0, 1]),
        lambda: t.upload_rows([0], "a purpose never used"),
        t.synchronize,
    ]
    live, refused = len(t), 0
    for call in calls:
        try:
            call()
        except StateError as e:
            assert "capturing" in str(e)
            refused += 1
    ops.end_capture()
    if blind:
        return ops, refused, len(calls)
    assert len(t) == live and dict(ops.issued) == issued
    t.apply(so)  # the step refused during the capture, now
    # a stale mirror's resync waits for the capture to end too
    ops.fail_on = "replay"
    with pytest.raises(MirrorFaultError):
        t.apply(next(steps))
    so = next(steps)
    ops.begin_capture()
    with pytest.raises(StateError, match="capturing"):
        t.apply(so)
    ops.end_capture()
    assert t._mirror.stale
    t.apply(so)  # resynchronizes, then applies
    assert not t._mirror.stale
    return ops, refused, len(calls)


# ----------------------------------------------------------------------------
# faults before and after the step's work was queued


def _forget_progress(mirror):
    """The mutant: a failed step's work all left to the next call, queued or not."""
    ship = mirror._ship

    def forgetful(slot, n, n_tok):
        try:
            ship(slot, n, n_tok)
        finally:
            if mirror._fault is not None:
                mirror._fault.done, mirror._fault.slot_done = 0, False

    mirror._ship = forgetful


def _advance_new_rows(ops, t, rows, drafts):
    """The engine's device code after a step: it advances the new rows'
    lengths and writes their drafts (queued on the consumer's stream)."""
    d = t.device_tensors
    idx = torch.as_tensor(rows, dtype=torch.int64)

    def run():
        d.total_len[idx] += 5
        d.engine_num_computed_tokens[idx] += 5
        drafts[idx] = 9

    ops.enqueue(run)


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_work_queued_before_a_fault_is_not_issued_again(graphs):
    """Steps with arrivals whose last operation (the slot's event record)
    fails: all of their work was queued, so the error says the mirror is not
    stale, the engine goes on and its device code advances the new rows;
    the next call waits for the device and re-seeds nothing. The mutant
    that forgets what was queued re-issues the step and overwrites the
    engine's advance, and is caught."""
    for forgetful in (False, True):
        ops = DeferredOps(torch, seed=5, graphs=graphs)
        t, target, drafts = _engine(ops)
        if forgetful:  # keeps no count of what was queued: the next call re-issues the whole step
            _forget_progress(t._mirror)
        seeds = EngineSeeds()
        faults = bad = 0
        for k, so in enumerate(_sim(seed=5).run(60)):
            if k % 4 != 3 or not so.scheduled_new_reqs:
                seeds.record(so, t.apply(so))
                continue
            ops.fail_on = "record"
            with pytest.raises(MirrorFaultError) as e:
                t.apply(so)
            assert ops.fail_on is None
            assert forgetful or (not e.value.stale and not t._mirror.stale)
            faults += 1
            res = t._result
            seeds.record(so, res)
            rows = res.new_rows.tolist()
            _advance_new_rows(ops, t, rows, drafts)
            t.synchronize()
            d = t.device_tensors
            for row in rows:
                tokens, nct = seeds.rows[row]
                ok = int(d.total_len[row]) == len(tokens) + 5 and int(d.engine_num_computed_tokens[row]) == nct + 5
                bad += not (ok and bool((drafts[row] == 9).all()))
            d.total_len[rows] -= 5  # (back to the seeded values, which later checks expect)
            d.engine_num_computed_tokens[rows] -= 5
        assert faults > 3
        assert (bad > 0) == forgetful, (forgetful, bad)
        if not forgetful:
            _assert_device_equals_host(t, target, seeds)


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_work_not_queued_is_issued_once_by_the_next_call(graphs):
    """The first operation of a step with arrivals fails: nothing was queued,
    the mirror is stale, the engine runs nothing on it; the next call
    (synchronize) issues the step's work, the engine's lengths and drafts
    seeded exactly as an unfaulted step would."""
    ops = DeferredOps(torch, seed=6, graphs=graphs)
    t, target, drafts = _engine(ops)
    seeds = EngineSeeds()
    faults = 0
    for k, so in enumerate(_sim(seed=6).run(60)):
        if k % 4 == 3 and so.scheduled_new_reqs:
            drafts.fill_(7)  # (the speculator's last fill: the new rows must read 0 after the resync)
            ops.fail_on = "replay" if graphs else "copy"
            with pytest.raises(MirrorFaultError) as e:
                t.apply(so)
            assert e.value.stale and t._mirror.stale
            faults += 1
            seeds.record(so, t._result)
            t.synchronize()
            assert not t._mirror.stale
            assert (drafts[t._result.new_rows.tolist()] == 0).all()
            _assert_device_equals_host(t, target, seeds)
        else:
            seeds.record(so, t.apply(so))
    assert faults > 3
    _assert_device_equals_host(t, target, seeds)


@pytest.mark.parametrize("at", [2, 3], ids=["chunk replay", "chunk record"])
def test_token_ids_past_a_fault_in_the_overflow_ring_are_kept(at):
    """Token areas of 8 token ids: a step's first overflow chunk fails at its
    replay (or its event record). The token ids not yet queued are copied
    out of the step's requests before apply returns (their objects are gone
    by the next call); the next call ships them, and every row holds what
    its add seeded."""
    ops = DeferredOps(torch, seed=9)
    t, target, _ = _engine(ops, token_chunk=8)
    steps = list(_sim(seed=9).run(50))
    seeds = EngineSeeds()
    seeds.record(steps[0], t.apply(steps[0]))  # (the stream followed: no stream wait in the steps below)
    faults = 0
    for so in steps[1:]:
        if sum(len(r.prompt_token_ids) for r in so.scheduled_new_reqs) > 8:
            ops.fail_at = sum(ops.issued.values()) + at  # (the slot's replay and record, then the first chunk's)
            with pytest.raises(MirrorFaultError) as e:
                t.apply(so)
            ops.fail_at = None
            assert e.value.stale and t._mirror.stale
            faults += 1
            seeds.record(so, t._result)
            for r in so.scheduled_new_reqs:  # what apply held is gone
                r.prompt_token_ids = r.prefill_token_ids = None
            t.synchronize()
            _assert_device_equals_host(t, target, seeds)
        else:
            seeds.record(so, t.apply(so))
    assert faults > 3
    _assert_device_equals_host(t, target, seeds)


def test_a_lost_device_is_unusable_with_one_clear_error():
    """A sticky device error: the step it hits raises (stale), the next call
    finds the device cannot be waited for and says it is unusable; every
    later call says the same without touching the device, and changes
    nothing on the host."""
    ops = DeferredOps(torch, seed=7)
    t, target, _ = _engine(ops)
    steps = iter(_sim(seed=7).run(40))
    for _ in range(6):
        t.apply(next(steps))
    t.synchronize()  # (no slot in flight: the next step gets as far as its replay)
    ops.lose_device()
    with pytest.raises(MirrorFaultError, match="applied to the host"):
        t.apply(next(steps))
    with pytest.raises(MirrorFaultError, match="unusable") as first:
        t.apply(next(steps))
    issued, live, state = dict(ops.issued), len(t), t._state.copy()
    for call in (lambda: t.apply(next(steps)), t.synchronize, lambda: t.upload_rows([0])):
        with pytest.raises(MirrorFaultError) as again:
            call()
        assert str(again.value) == str(first.value)
    assert dict(ops.issued) == issued and len(t) == live
    np.testing.assert_array_equal(state, t._state)


# ----------------------------------------------------------------------------
# lifetime


@pytest.mark.parametrize("drop", ["close", "del"])
def test_buffers_outlive_the_replays_that_read_them(drop):
    """A table closed (or dropped) while its steps' replays are still queued
    behind a held-back consumer: the replays still run on live buffers
    (the close waits for them); the mutant that releases without waiting
    leaves a queued replay whose graph's tensors are gone."""
    from mtpstate.mirror import device_mirror as mirror_module

    for waits in (True, False):
        ops = DeferredOps(torch, seed=8)
        t, target, _ = _engine(ops)
        steps = iter(_sim(seed=8).run(20))
        for _ in range(4):
            t.apply(next(steps))
        ops.synchronize()
        ops.hold(ops.default)
        t.apply(next(steps))  # queued, not run
        real = mirror_module._release
        if not waits:
            mirror_module._release = lambda ops_, held: held.clear()
            t._mirror._finalizer.detach()
            t._mirror._finalizer = mirror_module.weakref.finalize(
                t._mirror, mirror_module._release, ops, t._mirror._held
            )
        try:
            if drop == "close":
                t.close()
                with pytest.raises(StateError, match="closed"):
                    t.apply(next(steps))
            else:
                del t
            gc.collect()
            gc.collect()  # (the buffers the finalizer held go in the pass after the one that ran it)
        finally:
            mirror_module._release = real
        ops.release(ops.default)
        if waits:
            ops.synchronize()  # nothing left that reads freed buffers
        else:
            with pytest.raises(RuntimeError, match="freed"):
                ops.synchronize()


# ----------------------------------------------------------------------------
# out of memory while building


class _OutOfMemoryAt(DeferredOps):
    """Device allocation number ``at`` (or any capture, with ``capture``)
    fails as CUDA's allocator does."""

    def __init__(self, at=None, capture=False):
        super().__init__(torch)
        self.at, self.capture_fails, self.allocations = at, capture, 0

    def empty(self, n, dtype):
        self.allocations += 1
        if self.allocations == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().empty(n, dtype)

    def capture(self, work, pool=None):
        if self.capture_fails:
            raise torch.OutOfMemoryError("CUDA out of memory during graph capture")
        return super().capture(work, pool)


def test_out_of_memory_while_building_leaves_no_half_built_table():
    """An allocation that fails: a StateError naming the sizes to lower, no
    table. A capture that fails: the eager path, said in repr and
    transfer_stats, and every step still correct."""
    for at in (1, 2, 4):
        with pytest.raises(StateError, match="staging_capacity"):
            _engine(_OutOfMemoryAt(at=at))
    ops = _OutOfMemoryAt(capture=True)
    t, target, _ = _engine(ops)
    stats = t.transfer_stats()
    assert stats["path"] == "eager" and "out of memory" in stats["graph_error"] and "capture failed" in repr(t)
    seeds = EngineSeeds()
    for so in _sim(seed=10).run(30):
        seeds.record(so, t.apply(so))
    _assert_device_equals_host(t, target, seeds)


# ----------------------------------------------------------------------------
# targets


def test_targets_on_another_device_are_refused():
    """Engine tensors are checked by resolved device, not only its type."""
    ops = DeferredOps(torch)
    R, L = 4, 32
    meta = torch.empty((R, L), dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="same device"):
        RequestTable(
            max_num_reqs=R, max_model_len=L, device="cpu", mirror_options={"ops": ops, "token_ids_target": meta}
        )
    z = torch.empty((R, 3), dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="same device"):
        RequestTable(
            max_num_reqs=R, max_model_len=L, device="cpu", mirror_options={"ops": ops, "zero_rows_on_add": (z,)}
        )


# ----------------------------------------------------------------------------
# CUDA: run by `make gpu-check` wherever a GPU is present (skipped otherwise)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_engine(R, L, block_sizes=(16,), target=None, **options):
    return _engine(None, R, L, block_sizes, device="cuda", target=target, **options)


@pytest.mark.cuda
@cuda
def test_cuda_the_mirror_follows_the_consumer_to_another_stream():
    """The consumer moves to another stream without ordering it after the
    old one, whose queue is held back (a long sleep before the last step's
    replay): the mirror's own stream-follow wait must keep the steps in
    order, so the device ends equal to the host, and a snapshot taken on
    the new stream after its step sees that step."""
    t, target, _ = _cuda_engine(64, 512, block_sizes=(16, 32))
    seeds = EngineSeeds()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    snaps = []
    for k, so in enumerate(_sim(64, 512, seed=11).run(80)):
        s = streams[k % 2]  # a move every step, never ordered by the test
        with torch.cuda.stream(s):
            torch.cuda._sleep(3_000_000)  # this stream held back, before the step's replay
            seeds.record(so, t.apply(so))
            d = t.device_tensors
            snaps.append(([b.clone() for b in d.block_tables], [b.copy() for b in t.block_tables]))
    torch.cuda.synchronize()
    for dev, host in snaps:
        for a, b in zip(dev, host):
            np.testing.assert_array_equal(a.cpu().numpy(), b)
    _assert_device_equals_host(t, target, seeds)


@pytest.mark.cuda
@cuda
def test_cuda_uva_token_target():
    """vLLM's default all_token_ids: pinned host memory mapped into the
    device (a UVA view). New requests' token ids are scattered into it by
    the step's replay; the host memory itself holds them once the step's
    work has run."""
    from mtpstate.tools.vllm_bench.shims import uva_view

    R, L = 64, 2048
    host = torch.full((R, L), -1, dtype=torch.int32, pin_memory=True)
    target = uva_view(host)
    t, _, _ = _cuda_engine(R, L, target=target)
    assert t.transfer_stats()["path"] == "graph", t.transfer_stats()["graph_error"]
    seeds = EngineSeeds()
    for so in _sim(R, L, seed=12, prompt_len=(1, 1500)).run(60):
        seeds.record(so, t.apply(so))
    t.synchronize()
    for row, (tokens, _) in seeds.rows.items():
        assert host[row, : len(tokens)].tolist() == tokens, row


@pytest.mark.cuda
@cuda
def test_cuda_a_20k_prompt_at_vllm_sizes_grows_nothing(record_property):
    """R = 1024, L = 32768, the adapter's configuration: one step adding a
    20k-token prompt (and one adding 16 of them) allocates nothing on the
    device and captures no graph; the step's wall time (apply, then the
    device's completion) is recorded in the test report."""
    import time

    from mtpstate.tools.sim import NewRequestData, SamplingParams, SchedulerOutput

    R, L = 1024, 32768
    t, target, _ = _cuda_engine(R, L)
    captures = []
    real_capture = t._mirror.ops.capture
    t._mirror.ops.capture = lambda *a, **k: captures.append(a) or real_capture(*a, **k)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    rng = np.random.default_rng(0)
    block = 0
    for n_new in (1, 16):
        new = []
        for i in range(n_new):
            tokens = rng.integers(0, 50000, 20000).tolist()
            blocks = list(range(block, block + 20000 // 16 + 1))
            block += len(blocks)
            new.append(NewRequestData(f"big-{n_new}-{i}", tokens, SamplingParams(16), (blocks,), 0))
        so = SchedulerOutput(scheduled_new_reqs=new)
        t0 = time.perf_counter()
        res = t.apply(so)
        host_s = time.perf_counter() - t0
        t.synchronize()
        record_property(f"apply_ms_{n_new}x20k", round(1e3 * host_s, 3))
        record_property(f"landed_ms_{n_new}x20k", round(1e3 * (time.perf_counter() - t0), 3))
        for r, row in zip(new, res.new_rows.tolist()):
            assert target[row, :20000].cpu().tolist() == r.prompt_token_ids
    assert torch.cuda.memory_reserved() == reserved and not captures
    record_property("transfer_stats", t.transfer_stats())


@pytest.mark.cuda
@cuda
def test_cuda_calls_during_an_engine_capture_leave_it_valid():
    """Inside an engine's torch.cuda.graph capture: building a device table,
    apply, upload_rows and synchronize raise StateError; the engine's graph
    captures exactly its own work, and the table works after the capture."""
    t, target, _ = _cuda_engine(64, 512)
    steps = iter(_sim(64, 512, seed=13).run(20))
    for _ in range(3):
        t.apply(next(steps))
    t.synchronize()
    so = next(steps)
    x = torch.zeros(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    refused = 0
    with torch.cuda.graph(g):
        x.add_(1)
        for call in (lambda: _cuda_engine(8, 64), lambda: t.apply(so), t.synchronize, lambda: t.upload_rows([0])):
            try:
                call()
            except StateError:
                refused += 1
        x.add_(1)
    assert refused == 4
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4
    seeds = EngineSeeds()
    seeds.record(so, t.apply(so))
    t.synchronize()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_a_target_on_another_gpu_is_refused():
    target = torch.zeros((8, 64), dtype=torch.int32, device="cuda:1")
    with pytest.raises(ValueError, match="same device"):
        RequestTable(max_num_reqs=8, max_model_len=64, device="cuda:0", mirror_options={"token_ids_target": target})


def test_the_device_bench_reports_the_mirror_at_vllm_sizes(tmp_path):
    """`mtpstate bench --only device` (quick, N = 1) also serves at vLLM's
    sizes and reports it: memory within twice a step's bound, nothing
    captured or allocated after construction, in the console and the JSON."""
    import io
    import json

    from mtpstate.tools.bench import run

    out, path = [], tmp_path / "device.json"
    run(quick=True, sizes=[1], what=("device",), json_path=str(path), out=out.append, progress_stream=io.StringIO())
    s = json.loads(path.read_text())["device"]["serving"]
    assert s["config"]["max_num_reqs"] == 1024 and s["config"]["max_model_len"] == 32768 and s["config"]["arrivals"] > 0
    assert s["captures_serving"] == 0 and s["allocations_serving"] == 0 and s["captures_built"] > 0
    assert 0 < s["pinned_bytes"] <= 2 * s["step_bytes_bound"] and 0 < s["device_bytes"] <= 2 * s["step_bytes_bound"]
    assert "vLLM's sizes" in out[0] and "0 captures" in out[0]
