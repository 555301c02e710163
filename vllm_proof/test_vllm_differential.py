"""`make test-vllm`: mtpstate against the tier's vLLM release's real scheduler and real
Model Runner V2 state code (mtpstate.tools.vllm_verify.runs), and StepResult.batch against
its real gather_batch_req_state. Several thousand real steps, 0
disagreements; the legacy table (increments num_computed_tokens) must
disagree under speculative decoding, which shows the comparison can fail."""

import os
from dataclasses import replace

import pytest

from mtpstate.tools.vllm_bench.shims import install_cpu_shims
from mtpstate.tools.vllm_bench.workloads import WORKLOADS, write_model_dir
from mtpstate.tools.vllm_verify.runs import run_table_differential

STEPS = int(os.environ.get("MTPSTATE_VLLM_STEPS", "800"))


@pytest.fixture(scope="module")
def model_dir():
    install_cpu_shims()
    return write_model_dir()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_agrees_with_vllm(model_dir, name):
    w = WORKLOADS[name]
    w = replace(w, steps=min(w.steps * STEPS // 400, STEPS))
    r = run_table_differential(w, model_dir)
    print(r)
    assert r["steps"] == w.steps
    assert r["batch_steps"] == w.steps  # StepResult.batch vs gather_batch_req_state, every step
    assert r["disagreements"] == 0, r["first"]
    assert r["python_path_steps"] == 0  # vLLM's TokenBuffers and lists are read in place
    if w.num_spec:  # the negative control: the pre-fix engine drifts under speculative decoding
        assert r["control_disagreements"] > 0
    k = r["kinds"]
    assert k["new"] > 0 and k["cached"] > 0 and k["finished"] > 0
    if "preempt" in name:
        assert k["preempted"] > 0
    if "256" in name:
        assert k["max_running"] >= 256
    if "1024" in name:
        assert k["max_running"] >= 1024
    if w.num_spec:
        assert k["spec_tokens"] > 0
    if w.prefix_caching:
        assert k["prefix_hits"] > 0
    if w.prompt_embeds:
        assert k["prompt_embeds"] > 0
