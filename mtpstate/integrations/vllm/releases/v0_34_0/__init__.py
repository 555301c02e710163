"""vLLM 0.34.0: what mtpstate changes, computes and relies on, as
fingerprints of each definition's source
(:func:`mtpstate.integrations.vllm._source.fingerprint`), and its patch
(``mrv2.patch`` beside this file). `make test-vllm` checks every
fingerprint against the release's source and the patch against it."""

from mtpstate.integrations.vllm.releases.release import Release

RELEASE = Release(
    version="0.34.0",
    # the GPUModelRunner methods the patch changes
    runner={
        "GPUModelRunner.initialize_kv_cache": "1448e2e7ef215ad1",
        "GPUModelRunner.finish_requests": "9d233fb3ba26819b",
        "GPUModelRunner.add_requests": "a4722eb66b8dc9e4",
        "GPUModelRunner.update_requests": "c00d9f68aa56f3f8",
        "GPUModelRunner.gather_batch_req_state": "7cdfd392a83f5d45",
        "GPUModelRunner.prepare_inputs": "b6bf942b2ea1af3d",
    },
    # vLLM functions whose results mtpstate computes in their place (the
    # patched runner calls them only where mtpstate does not)
    computed={
        "vllm.v1.worker.gpu.input_batch": {
            "expand_idx_mapping": "3ecf689a9f7c8516",
            "_expand_idx_mapping_kernel": "d86019216156350d",
        },
    },
    # the sampler methods whose answers and per-request writes mtpstate
    # makes, the bodies it keeps, and the UVA pools it uploads into
    sampler={
        "vllm.v1.worker.gpu.sample.sampler": {
            "Sampler.add_request": "ae3019624cf50ab2",
            "Sampler.get_logprobs_dims": "0e2a4743b51029ba",
            "Sampler.apply_sampling_params": "da3036b9f32e1a05",
            "Sampler.apply_staged_writes": "fefa37610bd91f77",
        },
        "vllm.v1.worker.gpu.sample.states": {
            "SamplingStates.add_request": "ee0f73b7845ab635",
            "SamplingStates.masks_logits": "8674ee08b358696e",
            "SamplingStates.any_greedy": "ff73c193006f6bc4",
            "SamplingStates.any_explicit_seed": "c4c1cb53d4df49a8",
            "SamplingStates.max_num_logprobs": "9259cc196828617f",
            "SamplingStates.get_top_k_top_p": "74c1383cd7f7bf4c",
            "SamplingStates.apply_top_k_top_p": "e48fa814d6938bb2",
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
        # (read as its field _bad_words_token_ids, which it returns)
        "vllm.sampling_params": {"SamplingParams.bad_words_token_ids": "743c21e622d4fd8a"},
        "vllm.v1.worker.gpu.buffer_utils": {
            "UvaBackedTensor.__init__": "dd7a373319a883c3",
            "UvaBackedTensor.copy_to_uva": "b216fe950776b18c",
            "UvaBufferPool._next_buf": "c013dc1874f16bc4",
            "UvaBufferPool.copy_to_uva": "d23daac4f9032095",
        },
    },
    differences="the reference: mtpstate's patch and kernels were written against this release",
)
