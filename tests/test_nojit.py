"""The kernels run as plain Python under NUMBA_DISABLE_JIT=1 (``make test``
runs this file that way), so their code and the ctypes fallbacks of the
low-level primitives are exercised and covered too."""

import pytest
from test_index import (  # noqa: F401
    test_forced_collisions_never_return_another_row,
    test_generic_inputs_and_fresh_strings,
    test_ids_that_differ_past_the_first_word_and_in_length,
    test_rejected_calls_change_nothing,
)

from mtpstate._kernels.jit import JIT_DISABLED

pytestmark = pytest.mark.skipif(not JIT_DISABLED, reason="collected again by `make test` under NUMBA_DISABLE_JIT=1")


def test_jit_is_disabled():
    from mtpstate._kernels import index as _kernels

    assert not hasattr(_kernels.ix_find, "signatures")


def test_table_differential_nojit():
    from helpers import run_differential

    cfg = dict(max_num_reqs=12, max_model_len=256, block_sizes=(16, 32))
    for mode in ("new", "cached"):
        run_differential(
            cfg,
            25,
            num_spec=2,
            accept=0.5,
            preempt_prob=0.3,
            abort_prob=0.2,
            abort_waiting_prob=0.2,
            prefix_hit_prob=0.3,
            remote_kv_prob=0.3,
            resume_mode=mode,
            prompt_len=(1, 80),
            output_len=(1, 30),
            seed=2,
        )


def test_table_bad_steps_nojit():
    from test_table import BAD_STEPS, test_bad_step_changes_nothing

    for name in sorted(BAD_STEPS):
        test_bad_step_changes_nothing(name)


def test_new_requests_read_in_place_nojit():
    """The attribute reads (getattr_held) and the holder list as plain Python."""
    from test_table import test_a_base_exception_in_a_new_request_property_propagates as base_exception
    from test_table import test_new_request_attributes_are_read_once as read_once

    for shape in ("in place", "a generator prompt", "no prefill attribute", "a long id", "raises at the last"):
        read_once(shape)
    base_exception()


def test_reference_counts_nojit():
    from test_table import test_reference_counts_balance

    test_reference_counts_balance()


def test_batch_differential_nojit():
    """StepResult.batch as plain Python (dict entries, the kernel-made list)."""
    from test_batch import drive

    from mtpstate.tools.workloads import vllm_busy

    warm, timed = vllm_busy(12, steps=6, seed=1)
    drive(timed, 12, dql=4, fresh=True, warm=warm)


def test_engine_mirror_nojit():
    """The engine configuration of the mirror (token ids staged for an
    external target with no host copy, engine lengths, a field mask) as plain
    Python: checked against what each added row seeded."""
    torch = pytest.importorskip("torch")
    import numpy as np
    from helpers import EngineSeeds, engine_mirror_options

    from mtpstate import RequestTable
    from mtpstate.tools.sim import Simulator

    R, L = 8, 128
    sim = Simulator(max_num_reqs=R, max_model_len=L, num_spec=2, preempt_prob=0.2, prompt_len=(1, 40), seed=3)
    target = torch.full((R, L), -1, dtype=torch.int32)
    t = RequestTable(max_num_reqs=R, max_model_len=L, device="cpu", mirror_options=engine_mirror_options(target))
    d = t.device_tensors
    seeds = EngineSeeds()
    for so in sim.run(20):
        seeds.record(so, t.apply(so))
        seeds.check(t, target)
        np.testing.assert_array_equal(d.prefill_len.numpy(), t.prefill_len)
        np.testing.assert_array_equal(d.block_tables[0].numpy(), t.block_tables[0])


def test_token_runs_and_chunks_nojit():
    """New requests' token ids staged as runs, the slot's token area and the
    overflow chunks (tokens.py) as plain Python, on the deferred device."""
    pytest.importorskip("torch", reason="the device mirror needs torch")
    import torch
    from test_mirror_ordering import _drive, _engine, _sim

    from mtpstate.devices import DeferredOps

    ops = DeferredOps(torch, seed=3)
    t, checker, seeds = _engine(ops, 2, R=16, L=128, token_chunk=8)
    assert _drive(ops, t, checker, _sim(16, 128, 3), 15, 3, seeds=seeds) == 0


def test_sampler_answers_nojit():
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test
    from test_sampler_answers import (
        CountedAnswers,
        test_a_changed_row_changes_the_answer,
        test_a_row_that_is_not_an_int_makes_every_batch_a_pass,
        test_answers_equal_vllms_numpy,
    )

    test_a_changed_row_changes_the_answer()
    test_answers_equal_vllms_numpy()
    test_a_row_that_is_not_an_int_makes_every_batch_a_pass()
    run_state_machine_as_test(CountedAnswers, settings=settings(max_examples=30, stateful_step_count=30, deadline=None))


def test_sampling_params_nojit():
    from test_sampling_params import (
        test_seed_draw_matches_numpy_at_its_edges,
        test_unreadable_params_are_reported,
        test_uploads_fill_each_slot_with_what_changed_since_it_was_filled,
        test_writes_equal_vllms_add_request,
    )

    test_writes_equal_vllms_add_request()
    test_seed_draw_matches_numpy_at_its_edges()
    test_unreadable_params_are_reported()
    test_uploads_fill_each_slot_with_what_changed_since_it_was_filled()
