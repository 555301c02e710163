"""Simulator invariants, trace round-trip and rejection of bad files, replay
results (the command line: test_cli.py)."""

import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpstate.tools.replay import replay
from mtpstate.tools.sim import SimConfig, Simulator
from mtpstate.tools.trace import TraceError, load, record, save

configs = st.builds(
    SimConfig,
    max_num_reqs=st.integers(1, 32),
    max_model_len=st.sampled_from([128, 1024]),
    max_num_batched_tokens=st.sampled_from([16, 256, 2048]),
    block_sizes=st.sampled_from([(16,), (8, 32)]),
    arrivals_per_step=st.floats(0.1, 4),
    prompt_len=st.just((1, 100)),
    output_len=st.just((1, 60)),
    num_spec=st.integers(0, 4),
    accept=st.floats(0, 1),
    preempt_prob=st.floats(0, 0.3),
    abort_prob=st.floats(0, 0.3),
    abort_waiting_prob=st.floats(0, 0.3),
    prefix_hit_prob=st.floats(0, 0.5),
    remote_kv_prob=st.floats(0, 0.5),
    resume_mode=st.sampled_from(["new", "cached"]),
    seed=st.integers(0, 2**32),
)


@settings(max_examples=40)
@given(cfg=configs, steps=st.integers(1, 80))
def test_simulator_invariants(cfg, steps):
    sim = Simulator(cfg)
    live: set[str] = set()
    blocks: dict[str, list[int]] = {}
    for so in sim.run(steps):
        # token budget respected, totals consistent
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        gone = set(so.finished_req_ids) | set(so.preempted_req_ids or ())
        live -= gone
        c = so.scheduled_cached_reqs
        new_ids = [r.req_id for r in so.scheduled_new_reqs]
        # ids unique; new ids are not live; cached ids are live
        assert len(set(new_ids)) == len(new_ids) and len(set(c.req_ids)) == len(c.req_ids)
        assert not set(new_ids) & live
        assert set(c.req_ids) <= live | set()
        for r in so.scheduled_new_reqs:
            prefill = r.prefill_token_ids if r.prefill_token_ids is not None else r.prompt_token_ids
            assert 0 <= r.num_computed_tokens <= len(prefill)
            blocks[r.req_id] = [len(g) for g in r.block_ids]
        for rid, b in zip(c.req_ids, c.new_block_ids):
            if b is not None:
                if rid in c.resumed_req_ids:
                    blocks[rid] = [len(g) for g in b]
                else:
                    blocks[rid] = [n + len(g) for n, g in zip(blocks[rid], b)]
        live |= set(new_ids)
        assert len(live) <= cfg.max_num_reqs
        # block counts cover the tokens computed plus those scheduled
        nct = dict(zip(c.req_ids, c.num_computed_tokens))
        nct.update({r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs})
        for rid, n in so.num_scheduled_tokens.items():
            for g, bs in enumerate(cfg.block_sizes):
                assert blocks[rid][g] >= min(math.ceil((nct[rid] + n) / bs), math.ceil(cfg.max_model_len / bs))
            assert nct[rid] + n <= cfg.max_model_len
        assert sim.truth == nct


def test_simulator_reproducible_by_seed():
    cfg = SimConfig(num_spec=2, preempt_prob=0.2, abort_prob=0.1, prefix_hit_prob=0.3, seed=42)
    a = [pickle.dumps(so) for so in Simulator(cfg).run(50)]
    b = [pickle.dumps(so) for so in Simulator(cfg).run(50)]
    c = [pickle.dumps(so) for so in Simulator(SimConfig(**{**cfg.__dict__, "seed": 43})).run(50)]
    assert a == b and a != c


def test_mtp_advances_by_accepted_plus_one():
    sim = Simulator(
        SimConfig(num_spec=3, accept=0.5, arrivals_per_step=1, prompt_len=(4, 8), output_len=(50, 60), seed=1)
    )
    prev = {}
    saw_rejection = False
    for so in sim.run(60):
        for rid, n in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens):
            if rid in prev and prev[rid][1] == 4:  # a decode step with 3 drafts
                adv = n - prev[rid][0]
                assert 1 <= adv <= 4
                saw_rejection |= adv < 4
        prev = {rid: (sim.truth[rid], so.num_scheduled_tokens[rid]) for rid in so.num_scheduled_tokens}
    assert saw_rejection


@settings(max_examples=15)
@given(cfg=configs, steps=st.integers(1, 40))
def test_trace_round_trip(tmp_path_factory, cfg, steps):
    path = tmp_path_factory.mktemp("t") / "x.trace"
    rec = record(cfg, steps, path)
    got = load(path)
    assert len(got) == steps
    assert got.steps == rec.steps  # every attribute of every object
    assert got.truth == rec.truth
    assert got.config["seed"] == cfg.seed


def test_trace_rejects_bad_files(tmp_path):
    path = tmp_path / "x.trace"
    record(SimConfig(seed=1), 20, path)
    raw = path.read_bytes()
    cases = {
        "foreign": b"PK\x03\x04 not a trace at all",
        "empty": b"",
        "truncated": raw[: len(raw) // 2],
        "truncated header": raw[:30],
        "flipped byte": raw[:-50] + bytes([raw[-50] ^ 0xFF]) + raw[-49:],
        "version": raw[:8] + (99).to_bytes(4, "little") + raw[12:],
        "trailing": raw + b"\0",
    }
    for name, data in cases.items():
        bad = tmp_path / f"{name}.trace"
        bad.write_bytes(data)
        with pytest.raises(TraceError) as err:
            load(bad)
        assert str(bad) in str(err.value), name
    assert "version 99" in str(pytest.raises(TraceError, load, tmp_path / "version.trace").value)
    with pytest.raises(ValueError):
        save(tmp_path / "y.trace", [], [{}], SimConfig())


def test_replay_drift(tmp_path):
    path = tmp_path / "mtp.trace"
    rec = record(
        SimConfig(
            num_spec=2,
            accept=0.5,
            max_num_reqs=16,
            prompt_len=(4, 64),
            output_len=(20, 80),
            preempt_prob=0.1,
            abort_prob=0.05,
            seed=3,
        ),
        120,
        path,
    )
    res = replay(load(path))
    assert res["steps"] == len(rec)
    assert res["impls"]["legacy"]["max_drift"] > 0
    assert res["impls"]["loop"]["max_drift"] == 0
    assert res["impls"]["vectorized"]["max_drift"] == 0
    assert res["agree"] is True
    # with every draft accepted the legacy engine does not drift
    path2 = tmp_path / "all.trace"
    record(
        SimConfig(num_spec=2, accept=1.0, max_num_reqs=16, prompt_len=(4, 64), output_len=(20, 80), seed=3), 80, path2
    )
    assert replay(load(path2), ("legacy",))["impls"]["legacy"]["max_drift"] == 0


def test_compare_with_vllm_shaped_objects():
    """A step compares equal, by attribute name, to a foreign object with
    vLLM's attribute names and other container types."""
    from types import SimpleNamespace as NS

    from mtpstate.tools.sim import step_differences

    sim = Simulator(SimConfig(num_spec=2, seed=2, preempt_prob=0.3))
    for so in sim.run(30):
        foreign = NS(
            finished_req_ids=frozenset(so.finished_req_ids),
            preempted_req_ids=so.preempted_req_ids,
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            scheduled_spec_decode_tokens={k: tuple(v) for k, v in so.scheduled_spec_decode_tokens.items()},
            scheduled_new_reqs=[
                NS(
                    req_id=r.req_id,
                    prompt_token_ids=tuple(r.prompt_token_ids),
                    prefill_token_ids=r.prefill_token_ids,
                    num_computed_tokens=r.num_computed_tokens,
                    block_ids=list(r.block_ids),
                    sampling_params=NS(max_tokens=r.sampling_params.max_tokens),
                )
                for r in so.scheduled_new_reqs
            ],
            scheduled_cached_reqs=NS(**vars(so.scheduled_cached_reqs)),
        )
        assert step_differences(so, foreign) == []
        if so.scheduled_cached_reqs.req_ids:
            foreign.scheduled_cached_reqs.num_computed_tokens = [
                n + 1 for n in so.scheduled_cached_reqs.num_computed_tokens
            ]
            assert step_differences(so, foreign) == ["scheduled_cached_reqs.num_computed_tokens"]


@pytest.mark.parametrize(
    "field,value",
    [("block_sizes", (0,)), ("prompt_len", (10, 5)), ("accept", 1.5), ("num_spec", -1), ("max_num_reqs", 0)],
)
def test_sim_config_rejects_nonsense(field, value):
    with pytest.raises(ValueError, match=f"SimConfig.{field}"):
        SimConfig(**{field: value})
