"""Device mirror: device tensors equal the host arrays after every step; the
transfer volume of a steady decode step; CUDA-only checks (marked ``cuda``)."""

import numpy as np
import pytest
from helpers import ENGINE_FIELDS, SIM_KNOBS, EngineSeeds, apply_through_arrays, engine_mirror_options, genericize
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip(
    "torch", reason="the device mirror needs torch: pip install 'mtpstate[torch]' (a CPU build: see the Makefile)"
)

from mtpstate import RequestTable, StateError  # noqa: E402
from mtpstate.tools.sim import CachedRequestData, SchedulerOutput, Simulator  # noqa: E402
from mtpstate.tools.workloads import steady_decode  # noqa: E402

NAMES = ["num_computed_tokens", "num_computed_prefill_tokens", "prefill_len", "prompt_len", "max_seq_len", "num_blocks"]


def assert_mirrored(t):
    t.synchronize()
    d = t.device_tensors
    for name in [*NAMES, "token_ids"]:
        np.testing.assert_array_equal(getattr(d, name).cpu().numpy(), getattr(t, name), err_msg=name)
    for g, bt in enumerate(t.block_tables):
        np.testing.assert_array_equal(d.block_tables[g].cpu().numpy(), bt, err_msg=f"block table {g}")


sim_knobs = st.fixed_dictionaries(
    {"max_num_reqs": st.integers(1, 16), "block_sizes": st.sampled_from([(16,), (4, 32)]), **SIM_KNOBS}
)


@settings(max_examples=25)
@given(
    knobs=sim_knobs, steps=st.integers(1, 40), on_device=st.booleans(), depth=st.integers(2, 4), generic=st.booleans()
)
def test_device_equals_host_after_every_step(knobs, steps, on_device, depth, generic):
    cfg = dict(max_num_reqs=knobs["max_num_reqs"], max_model_len=200, block_sizes=knobs["block_sizes"])
    sim = Simulator(**{**knobs, **cfg}, prompt_len=(1, 60), output_len=(1, 40))
    t = RequestTable(
        **cfg,
        device="cpu",
        mirror_options={"ring_depth": depth, "token_ids_on_device": on_device, "token_chunk": 8},
    )
    rng = np.random.default_rng(knobs["seed"])
    for so in sim.run(steps):
        t.apply(genericize(so, rng) if generic else so)
        assert_mirrored(t)


def test_update_arrays_and_phases_are_mirrored():
    cfg = dict(max_num_reqs=8, max_model_len=128, block_sizes=(16,))
    sim = Simulator(**cfg, num_spec=2, seed=4, prompt_len=(1, 50), output_len=(2, 30))
    t = RequestTable(**cfg, device="cpu")
    for so in sim.run(30):
        apply_through_arrays(t, so)
        assert_mirrored(t)


def test_rejected_step_stages_nothing():
    setup, timed = steady_decode(16, steps=2)
    t = RequestTable(max_num_reqs=16, max_model_len=16384, device="cpu")
    for so in setup:
        t.apply(so)
    t.apply(timed[0])
    assert_mirrored(t)
    before = {n: getattr(t.device_tensors, n).clone() for n in NAMES}
    bad = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["nope"], set(), [[]], [None], [1], [0]))
    with pytest.raises(StateError):
        t.apply(bad)
    for n in NAMES:
        assert torch.equal(before[n], getattr(t.device_tensors, n))
    t.apply(timed[1])
    assert_mirrored(t)


def test_steady_decode_transfer_volume():
    """N = 1024: well under 16 bytes per changed element, in at most 2 copies."""
    n = 1024
    setup, timed = steady_decode(n, steps=4)
    t = RequestTable(max_num_reqs=n, max_model_len=16384, device="cpu")
    for so in setup:
        t.apply(so)
    for so in timed:
        before = [t._state.copy(), t.block_tables[0].copy()]
        t.apply(so)
        changed = int((before[0] != t._state).sum() + (before[1] != t.block_tables[0]).sum())
        stats = t.transfer_stats()
        assert stats["copies"] <= 2
        assert stats["bytes"] <= 12 * changed + 64, (stats, changed)
    assert_mirrored(t)


def test_mirror_options_validated():
    with pytest.raises(ValueError):
        RequestTable(max_num_reqs=2, max_model_len=8, device="cpu", mirror_options={"ring_depth": 1})
    if not torch.cuda.is_available():
        with pytest.raises(StateError, match="CUDA"):
            RequestTable(max_num_reqs=2, max_model_len=8, device="cuda")


# ----------------------------------------------------------------------------
# CUDA: run wherever a GPU is present (skipped otherwise)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_host_token_ids_refused():
    """Host writes of new tokens into memory that kernels in flight read:
    refused on CUDA (an engine's tensor is written through the staged copy)."""
    with pytest.raises(ValueError, match="token_ids_target"):
        RequestTable(max_num_reqs=4, max_model_len=32, device="cuda", mirror_options={"token_ids_on_device": False})


def _snapshot(t):
    """Clones of every mirrored tensor, taken on the current stream (so in
    stream order: after the step's copy, before later steps' copies)."""
    d = t.device_tensors
    return [getattr(d, n).clone() for n in [*NAMES, "token_ids"]] + [b.clone() for b in d.block_tables]


def _host(t):
    return [getattr(t, n).copy() for n in [*NAMES, "token_ids"]] + [b.copy() for b in t.block_tables]


def _assert_snapshots(snaps, hosts):
    torch.cuda.synchronize()
    for k, (s, h) in enumerate(zip(snaps, hosts)):
        for a, b in zip(s, h):
            np.testing.assert_array_equal(a.cpu().numpy(), b, err_msg=f"snapshot {k}")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("on_device", [True])
def test_cuda_device_equals_host(on_device):
    cfg = dict(max_num_reqs=64, max_model_len=512, block_sizes=(16, 32))
    sim = Simulator(
        **cfg,
        num_spec=3,
        accept=0.6,
        preempt_prob=0.2,
        abort_prob=0.1,
        abort_waiting_prob=0.1,
        prefix_hit_prob=0.2,
        remote_kv_prob=0.2,
        prompt_len=(1, 200),
        output_len=(1, 100),
        seed=9,
    )
    t = RequestTable(**cfg, device="cuda", mirror_options={"token_ids_on_device": on_device})
    for so in sim.run(200):
        t.apply(so)
        assert_mirrored(t)


@pytest.mark.cuda
@cuda
def test_cuda_slots_not_reused_while_copy_in_flight():
    """The consumer's stream, where each step's replay runs, is held back
    (``torch.cuda._sleep``) while the host applies many steps quickly: if a
    staging slot were refilled before its replay ran, the device would end
    up with another step's values."""
    cfg = dict(max_num_reqs=256, max_model_len=4096, block_sizes=(16,))
    sim = Simulator(**cfg, num_spec=2, accept=0.5, prompt_len=(1, 300), output_len=(50, 400), seed=1)
    t = RequestTable(**cfg, device="cuda", mirror_options={"ring_depth": 2})
    assert t._mirror.path == "graph" and "mirror='graph'" in repr(t)
    snaps, hosts = [], []
    for so in sim.run(150):
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before this step's replay
        t.apply(so)
        snaps.append(_snapshot(t))  # every step, in stream order
        hosts.append(_host(t))
    _assert_snapshots(snaps, hosts)
    assert_mirrored(t)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("depth", [2, 3])
def test_cuda_rows_ring_under_held_back_stream(depth):
    """``upload_rows`` (the adapter's idx_mapping and new rows, every step)
    with the current stream held back: each result, cloned in stream order
    right after its upload, holds the rows of its own call, never a later
    refill of the same pinned buffer."""
    import random

    rng = random.Random(depth)
    t = RequestTable(max_num_reqs=256, max_model_len=64, device="cuda", mirror_options={"ring_depth": depth})
    clones, wants = [], []
    for _ in range(300):
        if rng.random() < 0.5:
            torch.cuda._sleep(rng.randrange(100_000, 2_000_000))  # the current stream, where the copies run
        want = np.array(rng.sample(range(256), rng.randrange(1, 256)), np.int64)
        out = t.upload_rows(want, "idx_mapping")
        clones.append(out.clone())
        wants.append(want)
    torch.cuda.synchronize()
    for k, (c, w) in enumerate(zip(clones, wants)):
        np.testing.assert_array_equal(c.cpu().numpy(), w, err_msg=f"upload {k}")


@pytest.mark.cuda
@cuda
def test_cuda_held_back_consumer_reads_old_values():
    """Work already queued on the consumer's stream (held back by a sleep)
    that reads the mirrored tensors must see the state from before the next
    step: the copy stream waits for it."""
    cfg = dict(max_num_reqs=128, max_model_len=1024, block_sizes=(16,))
    sim = Simulator(**cfg, num_spec=2, accept=0.5, prompt_len=(1, 200), output_len=(20, 200), seed=3)
    t = RequestTable(**cfg, device="cuda", mirror_options={"ring_depth": 2})
    snaps, hosts = [], []
    for so in sim.run(120):
        torch.cuda._sleep(2_000_000)  # the consumer's stream busy for ~1 ms ...
        snaps.append(_snapshot(t))  # ... then reading the state of the previous step
        hosts.append(_host(t))
        t.apply(so)
    _assert_snapshots(snaps, hosts)


@pytest.mark.cuda
@cuda
def test_cuda_array_entry_and_duplicates_every_step():
    """The array entry point (``stage_arrays``) and steps that stage an
    element twice (the last write must win, which a GPU scatter does not
    promise), checked in stream order after every step."""
    cfg = dict(max_num_reqs=8, max_model_len=128, block_sizes=(16,))
    sim = Simulator(**cfg, num_spec=2, seed=4, prompt_len=(1, 50), output_len=(2, 30))
    t = RequestTable(**cfg, device="cuda")
    snaps, hosts = [], []
    for so in sim.run(40):
        torch.cuda._sleep(500_000)
        apply_through_arrays(t, so)
        snaps.append(_snapshot(t))
        hosts.append(_host(t))
    from test_table import SAME_STEP_TABLE, same_step_steps

    t = RequestTable(**SAME_STEP_TABLE, device="cuda")
    setup, steps = same_step_steps()
    for so in setup + steps:
        torch.cuda._sleep(500_000)
        t.apply(so)
        snaps.append(_snapshot(t))
        hosts.append(_host(t))
    _assert_snapshots(snaps, hosts)


@pytest.mark.cuda
@cuda
def test_cuda_apply_returns_before_copy_completes():
    setup, timed = steady_decode(1024, steps=2)
    t = RequestTable(max_num_reqs=1024, max_model_len=16384, device="cuda")
    for so in setup:
        t.apply(so)
    t.synchronize()
    torch.cuda._sleep(200_000_000)  # ~100 ms on the consumer's stream, before the step's replay
    t.apply(timed[0])
    slot = t._mirror._slots[(t._mirror._next - 1) % t._mirror.ring_depth]
    assert slot.pending and not slot.event.query()  # still in flight
    assert_mirrored(t)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("depth", [2, 3])
def test_cuda_ring_reuse_stress(depth):
    """Async scheduling depth 2-3, many steps, the copy stream held back by a
    random amount before some steps: after each step a device-side snapshot
    of every mirrored tensor is taken in stream order (on the consumer
    stream, which waits for the step's copy) and the host state copied; at
    the end every snapshot must equal the host state of its own step. A
    staging slot refilled while its copy was in flight would show up as a
    snapshot holding another step's values."""
    import random

    rng = random.Random(depth)
    cfg = dict(max_num_reqs=128, max_model_len=1024, block_sizes=(16, 32))
    sim = Simulator(
        **cfg,
        num_spec=3,
        accept=0.6,
        preempt_prob=0.2,
        abort_prob=0.1,
        prompt_len=(1, 200),
        output_len=(20, 300),
        seed=depth,
    )
    t = RequestTable(**cfg, device="cuda", mirror_options={"ring_depth": depth})
    side = torch.cuda.Stream()
    names = [*NAMES, "token_ids"]
    snaps, hosts = [], []
    consumer = torch.cuda.current_stream()
    for so in sim.run(400):
        if rng.random() < 0.1:  # the consumer moves to the other stream (ordered after its own work)
            nxt = side if consumer == torch.cuda.current_stream() else torch.cuda.current_stream()
            nxt.wait_stream(consumer)
            consumer = nxt
        with torch.cuda.stream(consumer):
            if rng.random() < 0.5:
                torch.cuda._sleep(rng.randrange(100_000, 3_000_000))
            t.apply(so)
            d = t.device_tensors
            snaps.append([getattr(d, n).clone() for n in names] + [b.clone() for b in d.block_tables])
        hosts.append([getattr(t, n).copy() for n in names] + [b.copy() for b in t.block_tables])
        if len(snaps) >= 50:  # bounded memory: check and drop
            torch.cuda.synchronize()
            for s, h in zip(snaps, hosts):
                for a, b in zip(s, h):
                    np.testing.assert_array_equal(a.cpu().numpy(), b)
            snaps, hosts = [], []
    torch.cuda.synchronize()
    for s, h in zip(snaps, hosts):
        for a, b in zip(s, h):
            np.testing.assert_array_equal(a.cpu().numpy(), b)


# ----------------------------------------------------------------------------
# what an engine's runner needs: some fields only, its own lengths seeded per
# added row, new requests' tokens scattered into its tensor, row uploads


def _engine_table(R, L, block_sizes, target, device="cpu", **options):
    return RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=block_sizes,
        device=device,
        mirror_options=engine_mirror_options(target, **options),
    )


@settings(max_examples=20)
@given(knobs=sim_knobs, steps=st.integers(1, 40), generic=st.booleans())
def test_engine_targets_follow_every_step(knobs, steps, generic):
    """Mirrored fields equal the host; fields left out are never shipped;
    the engine's lengths and token tensor hold what each row's last add
    seeded (the engine's device code would advance them; nothing here does)."""
    R, L = knobs["max_num_reqs"], 200
    sim = Simulator(**{**knobs, "max_num_reqs": R, "max_model_len": L}, prompt_len=(1, 60), output_len=(1, 40))
    target = torch.full((R, L), -1, dtype=torch.int32)
    t = _engine_table(R, L, knobs["block_sizes"], target, token_chunk=8)
    d = t.device_tensors
    assert d.num_computed_tokens is None and d.max_seq_len is None and d.num_computed_prefill_tokens is None
    assert d.token_ids is not None and d.token_ids.data_ptr() == target.data_ptr()
    assert t.token_ids is None  # no host copy: the engine's tensor is the only one
    seeds = EngineSeeds()
    rng = np.random.default_rng(knobs["seed"])
    for so in sim.run(steps):
        seeds.record(so, t.apply(genericize(so, rng) if generic else so))
        for name in ENGINE_FIELDS:
            np.testing.assert_array_equal(getattr(d, name).numpy(), getattr(t, name), err_msg=name)
        for g, bt in enumerate(t.block_tables):
            np.testing.assert_array_equal(d.block_tables[g].numpy(), bt)
        seeds.check(t, target)
    assert t.transfer_stats()["copies"] in (0, 2)


def test_unmirrored_fields_are_not_staged():
    """A decode step that only advances num_computed_tokens ships nothing
    when that field is not mirrored (and 12 bytes per change when it is)."""
    n = 64
    setup, timed = steady_decode(n, steps=3)
    target = torch.zeros((n, 16384), dtype=torch.int32)
    lean = _engine_table(n, 16384, (16,), target, token_chunk=8)
    full = RequestTable(max_num_reqs=n, max_model_len=16384, device="cpu")
    for so in setup:
        lean.apply(so)
        full.apply(so)
    for so in timed:
        before = lean.num_blocks.copy()
        lean.apply(so)
        full.apply(so)
        appended = int((lean.num_blocks != before).sum())
        blocks = int((lean.num_blocks - before).sum())
        assert lean.transfer_stats()["bytes"] == 12 * (appended + blocks)
        assert full.transfer_stats()["bytes"] > lean.transfer_stats()["bytes"]


def test_engine_mirror_options_validated():
    with pytest.raises(ValueError, match="unknown mirrored fields"):
        RequestTable(max_num_reqs=2, max_model_len=8, device="cpu", mirror_options={"fields": ("nope",)})
    for bad in (torch.zeros((2, 8), dtype=torch.int64), torch.zeros((2, 9), dtype=torch.int32)):
        with pytest.raises(ValueError, match="token_ids_target"):
            RequestTable(max_num_reqs=2, max_model_len=8, device="cpu", mirror_options={"token_ids_target": bad})
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.zeros((8, 2), dtype=torch.int32).T
        RequestTable(max_num_reqs=2, max_model_len=8, device="cpu", mirror_options={"token_ids_target": t})


def test_upload_rows_ring():
    """Persistent buffers used round robin: results stay valid for
    ring_depth calls of the same purpose; purposes do not share buffers;
    more rows than max_num_reqs is a StateError."""
    t = RequestTable(max_num_reqs=8, max_model_len=16, device="cpu", mirror_options={"ring_depth": 3})
    m = t._mirror
    outs = [m.upload_rows(np.array([k, k + 1], np.intp)) for k in range(3)]
    other = m.upload_rows(np.array([7], np.intp), "other")
    assert [o.tolist() for o in outs] == [[0, 1], [1, 2], [2, 3]] and other.tolist() == [7]
    assert outs[0].dtype == torch.int64
    again = m.upload_rows(np.array([5, 6, 7], np.intp))  # reuses the first buffer
    assert again.data_ptr() == outs[0].data_ptr() and again.tolist() == [5, 6, 7]
    with pytest.raises(StateError, match="max_num_reqs"):
        m.upload_rows(np.arange(9))
    assert t.upload_rows([3, 4]).tolist() == [3, 4]  # the table's public entry
    with pytest.raises(StateError, match="no device mirror"):
        RequestTable(max_num_reqs=2, max_model_len=8).upload_rows([0])


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("depth", [2, 3])
def test_cuda_engine_targets_under_held_back_copies(depth):
    """The adapter's configuration on a GPU: token ids scattered into an
    engine tensor, lengths seeded per added row, only three fields mirrored,
    with the copy stream held back at random; checked in stream order after
    every step against what each row's last add seeded."""
    import random

    rng = random.Random(depth)
    R, L = 64, 512
    sim = Simulator(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=(16,),
        num_spec=3,
        accept=0.6,
        preempt_prob=0.2,
        abort_prob=0.1,
        prompt_len=(1, 200),
        output_len=(20, 200),
        seed=depth,
    )
    target = torch.full((R, L), -1, dtype=torch.int32, device="cuda")
    drafts = torch.full((R, 3), 7, dtype=torch.int64, device="cuda")
    t = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=(16,),
        device="cuda",
        decode_query_len=4,
        mirror_options=engine_mirror_options(target, ring_depth=depth, idx_mapping=True, zero_rows_on_add=(drafts,)),
    )
    assert t._mirror.path == "graph"
    d = t.device_tensors
    seeds = EngineSeeds()
    for so in sim.run(200):
        if rng.random() < 0.5:
            torch.cuda._sleep(rng.randrange(100_000, 2_000_000))  # the consumer's stream, before the replay
        res = t.apply(so)
        seeds.record(so, res)
        if res.batch is not None:
            np.testing.assert_array_equal(t.device_idx_mapping().cpu().numpy(), res.batch.idx_mapping_np)
        new = res.new_rows.tolist()
        if new:
            assert not drafts[new].any().item()  # zeroed in stream order
        drafts.fill_(7)  # the speculator writes every row
        seeds.check(t, target)
        np.testing.assert_array_equal(d.num_blocks.cpu().numpy(), t.num_blocks)
        np.testing.assert_array_equal(d.block_tables[0].cpu().numpy(), t.block_tables[0])


@pytest.mark.parametrize("R", [1, 2, 3, 5, 6, 7, 9, 13])
def test_every_view_is_16_byte_aligned(R):
    """Engines' kernels may assume aligned base pointers (vLLM's Triton block
    table loads hint a multiple of 16 bytes): every view the mirror hands
    out starts on a 16-byte boundary, whatever max_num_reqs and the block
    table widths, and the padded layout still mirrors the host exactly."""
    cfg = dict(max_num_reqs=R, max_model_len=200, block_sizes=(16, 32, 48))
    target = torch.zeros((R, 200), dtype=torch.int32)
    for options in ({}, engine_mirror_options(target), {"engine_lengths": True}):
        t = RequestTable(**cfg, device="cpu", mirror_options=options)
        d = t.device_tensors
        views = {n: getattr(d, n) for n in (*NAMES, "token_ids", "total_len", "engine_num_computed_tokens")}
        views.update({f"block_tables[{g}]": b for g, b in enumerate(d.block_tables)})
        for name, v in views.items():
            if v is not None:
                assert v.data_ptr() % 16 == 0, (R, options.keys(), name)
        sim = Simulator(**cfg, num_spec=2, prompt_len=(1, 60), output_len=(1, 40), seed=R)
        for so in sim.run(30):
            t.apply(so)
        t.synchronize()
        for name in NAMES:
            if getattr(d, name) is not None:
                np.testing.assert_array_equal(getattr(d, name).numpy(), getattr(t, name), err_msg=name)
        for g, bt in enumerate(t.block_tables):
            np.testing.assert_array_equal(d.block_tables[g].numpy(), bt)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_rows_ring_on_a_device_that_is_not_current():
    """A mirror on cuda:1 while cuda:0 is current: the row ring's copy runs
    on cuda:1's stream, and the event that guards the buffer's refill must
    be recorded there (recorded on the current device's stream it would not
    cover the copy, and a refill could overtake it)."""
    import random

    rng = random.Random(0)
    t = RequestTable(max_num_reqs=256, max_model_len=64, device="cuda:1", mirror_options={"ring_depth": 2})
    clones, wants = [], []
    with torch.cuda.device(0):
        for _ in range(200):
            with torch.cuda.device(1):
                torch.cuda._sleep(rng.randrange(100_000, 2_000_000))  # cuda:1's stream held back
            want = np.array(rng.sample(range(256), rng.randrange(1, 256)), np.int64)
            out = t.upload_rows(want)
            with torch.cuda.device(1):
                clones.append(out.clone())
            wants.append(want)
    torch.cuda.synchronize(1)
    for k, (c, w) in enumerate(zip(clones, wants)):
        np.testing.assert_array_equal(c.cpu().numpy(), w, err_msg=f"upload {k}")


def test_device_idx_mapping_and_new_rows_zeroed_on_the_host_path():
    """The adapter's extras on the CPU: each step's idx_mapping on the
    device side, valid for ring_depth steps; new rows of the given tensors
    zeroed by the step that adds them (the others untouched); the options
    checked."""
    R, L, depth = 16, 200, 3
    drafts = torch.full((R, 2), 9, dtype=torch.int64)
    t = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        decode_query_len=3,
        device="cpu",
        mirror_options={"ring_depth": depth, "idx_mapping": True, "zero_rows_on_add": (drafts,)},
    )
    assert "mirror='host'" in repr(t)
    with pytest.raises(StateError, match="no step"):
        t.device_idx_mapping()
    sim = Simulator(max_num_reqs=R, max_model_len=L, num_spec=2, prompt_len=(1, 60), output_len=(1, 40), seed=3)
    kept = []
    for so in sim.run(40):
        res = t.apply(so)
        new = res.new_rows.tolist()
        assert (drafts[new] == 0).all() and (drafts[[r for r in range(R) if r not in new]] == 9).all()
        drafts.fill_(9)
        kept.append((t.device_idx_mapping(), res.batch.idx_mapping_np.copy()))
        for got, want in kept[-depth:]:  # the last ring_depth steps' tensors are intact
            np.testing.assert_array_equal(got.numpy(), want)
    with pytest.raises(StateError, match="does not ship idx_mapping"):
        RequestTable(max_num_reqs=2, max_model_len=8, device="cpu").device_idx_mapping()
    with pytest.raises(ValueError, match="decode_query_len"):
        RequestTable(max_num_reqs=2, max_model_len=8, device="cpu", mirror_options={"idx_mapping": True})
    with pytest.raises(ValueError, match="zero_rows_on_add"):
        RequestTable(
            max_num_reqs=2, max_model_len=8, device="cpu", mirror_options={"zero_rows_on_add": (torch.zeros(3, 2),)}
        )


@pytest.mark.cuda
@cuda
def test_cuda_one_graph_launch_per_step():
    """On a GPU, what the design promises: each step's device work is one
    graph launch (no copy or kernel launched one by one), in the vLLM
    adapter's configuration, with and without arrivals, as the CUDA runtime
    calls recorded by the profiler count them."""
    from torch.profiler import ProfilerActivity, profile

    R, L = 64, 512
    sim = Simulator(max_num_reqs=R, max_model_len=L, num_spec=3, prompt_len=(1, 100), output_len=(5, 60), seed=2)
    target = torch.zeros((R, L), dtype=torch.int32, device="cuda")
    drafts = torch.zeros((R, 3), dtype=torch.int64, device="cuda")
    t = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        device="cuda",
        decode_query_len=4,
        mirror_options=engine_mirror_options(target, idx_mapping=True, zero_rows_on_add=(drafts,)),
    )
    assert t._mirror.path == "graph", t._mirror.graph_error
    steps = list(sim.run(40))
    for so in steps[:10]:
        t.apply(so)
    torch.cuda.synchronize()
    arrivals = sum(1 for so in steps[10:] if so.scheduled_new_reqs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for so in steps[10:]:
            t.apply(so)
    torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    runtime = [n for n in names if n.startswith("cuda")]
    if not runtime:
        pytest.skip("the profiler recorded no CUDA runtime calls here (no CUPTI)")
    launches = sum("GraphLaunch" in n for n in runtime)
    assert arrivals > 0 and launches == len(steps) - 10, (launches, arrivals)
    assert not [n for n in runtime if "LaunchKernel" in n or "MemcpyAsync" in n], sorted(set(runtime))
