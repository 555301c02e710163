"""vLLM 0.32.0: what mtpstate changes, computes and relies on (see
``v0_34_0``), and its patch (``mrv2.patch`` beside this file)."""

from mtpstate.integrations.vllm.releases.release import Release

RELEASE = Release(
    version="0.32.0",
    runner={
        "GPUModelRunner.initialize_kv_cache": "a5a3180a103a8e5b",
        "GPUModelRunner.finish_requests": "3eb9a96ac29b5e9c",
        "GPUModelRunner.add_requests": "1fc1f8be56e57bdf",
        "GPUModelRunner.update_requests": "920b7ec4a7e55953",
        "GPUModelRunner.gather_batch_req_state": "7cdfd392a83f5d45",
        "GPUModelRunner.prepare_inputs": "0ee8e8581f74b379",
    },
    computed={
        "vllm.v1.worker.gpu.input_batch": {
            "expand_idx_mapping": "3ecf689a9f7c8516",
            "_expand_idx_mapping_kernel": "d86019216156350d",
        },
    },
    sampler={
        "vllm.v1.worker.gpu.sample.sampler": {
            "Sampler.add_request": "db8e58017a22aae0",
            "Sampler.get_logprobs_dims": "a4df6ad00413aa2f",
            "Sampler.apply_sampling_params": "da3036b9f32e1a05",
            "Sampler.apply_staged_writes": "fefa37610bd91f77",
        },
        "vllm.v1.worker.gpu.sample.states": {
            "SamplingStates.add_request": "ee0f73b7845ab635",
            "SamplingStates.any_greedy": "ff73c193006f6bc4",
            "SamplingStates.any_explicit_seed": "c4c1cb53d4df49a8",
            "SamplingStates.max_num_logprobs": "9259cc196828617f",
            "SamplingStates.get_top_k_top_p": "7c5ecc45aa40686d",
            "SamplingStates.apply_top_k_top_p": "758a353f77e91b43",
            "SamplingStates.apply_temperature": "8182128a15189f56",
            "SamplingStates.apply_min_p": "23a7363247153f91",
        },
        "vllm.v1.worker.gpu.sample.penalties": {
            "PenaltiesState.add_request": "ded8a7060d05840d",
            "PenaltiesState.apply_staged_writes": "62f79bef3f1c1ca5",
            "PenaltiesState.apply": "419fda3540d4bbbc",
            "use_penalty": "ff3dc93dee445b03",
        },
        "vllm.v1.worker.gpu.sample.logit_bias": {
            "LogitBiasState.add_request": "748feaeadd4f762e",
            "LogitBiasState.apply": "976be2db6504afbe",
        },
        "vllm.v1.worker.gpu.sample.bad_words": {
            "BadWordsState.add_request": "4cef0a4ce358ecc3",
            "BadWordsState.apply": "6fec53b3c676f600",
        },
        "vllm.v1.worker.gpu.sample.thinking_budget": {
            "ThinkingBudgetState.add_request": "0cd18729b20c4194",
            "ThinkingBudgetState.apply": "f2054103012fc1d2",
        },
        "vllm.v1.worker.gpu.sample.logprob": {
            "LogprobTokenIdsState.add_request": "2fa93c33c57286e7",
            "LogprobTokenIdsState.max_num_token_ids": "db603214bd05ea8d",
        },
        "vllm.sampling_params": {"SamplingParams.bad_words_token_ids": "743c21e622d4fd8a"},
        "vllm.v1.worker.gpu.buffer_utils": {
            "UvaBackedTensor.__init__": "dd7a373319a883c3",
            "UvaBackedTensor.copy_to_uva": "b216fe950776b18c",
            "UvaBufferPool.copy_to_uva": "b54bdbbcdffbebf6",
        },
    },
    differences=(
        "runner: initialize_kv_cache builds the PCP manager after the block tables (the patch's hunk that builds "
        "mtpstate's state moved after it); prepare_inputs takes three values from adaptive verification's "
        "reallocate_drafts (outside the patch's lines). Sampler: SamplingStates.get_top_k_top_p takes no vocab size "
        "and returns (top_k, top_p), without has_topp_only_rows (mtpstate answers in the form vLLM's method has), "
        "and apply_top_k_top_p passes no has_topp_only_rows. Outside what mtpstate changes or relies on: "
        "RequestState.add_request zeroes the draft-token row without speculation too (a row of width 0 there, so the "
        "same values), BlockTables has no sliding-window reach (the shadow builds its block tables with what the "
        "live ones take)"
    ),
)
