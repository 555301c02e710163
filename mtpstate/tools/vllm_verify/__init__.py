"""mtpstate against vLLM's own code, step by step: what is compared
(``compare``), the differentials (``runs``), the known mutants that must be
caught (``sabotage``), and ``mtpstate vllm-verify`` (``verify``). The
repository's vLLM tier (``vllm_proof/``) runs the same code. Imports vLLM
only when a differential runs."""
