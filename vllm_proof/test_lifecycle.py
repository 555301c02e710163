"""`make test-vllm`, the engine's life around the steps, on the release's
real runner methods, RequestState, BlockTables and Sampler: the KV cache
initialized again (one live state, the sampler's wrappers one level deep,
the old state given back: as after a profiling build and the real one),
a dummy run's batch between steps (nothing the table keeps changes), and
the dummy sampler run's writes (rows no request holds: nothing mtpstate
counts changes); the runner differential agrees with vLLM's own methods
on every step all the same."""

import json
import os
import subprocess
import sys
import textwrap

CODE = textwrap.dedent(
    """
    import inspect, json
    from dataclasses import replace

    import numpy as np

    from mtpstate.integrations.vllm import ModelRunnerV2State
    from mtpstate.tools.vllm_bench.shims import install_cpu_shims
    from mtpstate.tools.vllm_bench.workloads import WORKLOADS, write_model_dir
    from mtpstate.tools.vllm_verify.runs import run_runner_differential

    install_cpu_shims()
    seen = {"dummy_writes": 0, "counts_unchanged": True, "dummy_batches": 0, "table_unchanged": True}

    def table_state(state):
        t = state.table
        return [t._state.copy(), t._index._ctx.copy(), *(b.copy() for b in t.block_tables)]

    def between(step, ref, patched):
        if step == 0:
            # initialize_kv_cache again (vLLM builds the state in it)
            first = patched.mtpstate
            second = patched.mtpstate = ModelRunnerV2State.for_runner(patched)
            seen["old_released"] = first.handed_back
            seen["live_is_new"] = patched._mtpstate_live is second and second is not first
            wrapper = patched.sampler.__dict__["add_request"]
            orig = inspect.getclosurevars(wrapper).nonlocals["orig_add_request"]
            seen["wrappers_one_level"] = orig.__func__.__module__.startswith("vllm.")
            seen["uploads_one_level"] = all(
                "copy_to_uva" not in vars(u) or type(vars(u)["copy_to_uva"]).__name__ == "_Uploaded"
                for u in second.sampler_answers.writer.uploads._uvas
            )
        if step in (7, 15, 30):
            # a dummy run's batch (_dummy_run, profile_run, capture_model):
            # prepare_inputs asks mtpstate for its inputs and idx_mapping
            from types import SimpleNamespace

            state = patched.mtpstate
            before = table_state(state)
            rows = np.arange(min(3, patched.req_states.max_num_reqs), dtype=np.int32)
            dummy = SimpleNamespace(idx_mapping_np=rows)
            assert state.batch_inputs(dummy, len(rows), 16, 1, None) is None
            assert state.idx_mapping(rows).tolist() == rows.tolist()
            seen["dummy_batches"] += 1
            seen["table_unchanged"] &= all(np.array_equal(x, y) for x, y in zip(before, table_state(state)))
        if step in (5, 12, 21):
            # _dummy_sampler_run's writes (warm-up params into rows 0..n-1):
            # here the rows no request holds, on both sides
            from vllm import SamplingParams

            sp = SamplingParams(temperature=0.5, top_p=0.9, top_k=10, min_p=0.1, logprobs=5)
            a = patched.mtpstate.sampler_answers
            before = (a._records.copy(), a._row_state.copy(), a._ctx.copy())
            for side in (ref, patched):
                used = set(side.req_states.index_to_req_id)
                free = [r for r in range(side.req_states.max_num_reqs) if r not in used][:4]
                for r in free:
                    side.sampler.add_request(r, sp)
                side.sampler.apply_staged_writes()
            seen["dummy_writes"] += len(free)
            after = (a._records, a._row_state, a._ctx)
            seen["counts_unchanged"] &= all(np.array_equal(x, y) for x, y in zip(before[:2], after[:2]))

    w = replace(WORKLOADS["sync-spec3-chunked"], steps=40)
    r = run_runner_differential(w, write_model_dir(), between=between)
    r.update(seen)
    print(json.dumps(r))
    """
)


def test_reinitialized_kv_cache_and_dummy_sampler_writes():
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    env.pop("VLLM_USE_MTPSTATE", None)
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["steps"] == 40 and r["disagreements"] == 0, r
    assert r["old_released"] == "released" and r["live_is_new"], r
    assert r["wrappers_one_level"] and r["uploads_one_level"], r
    assert r["dummy_writes"] > 0 and r["counts_unchanged"], r
    assert r["dummy_batches"] == 3 and r["table_unchanged"], r
