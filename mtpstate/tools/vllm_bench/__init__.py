"""mtpstate against vLLM 0.34's real scheduler and Model Runner V2 code:
the pieces the vLLM-level benchmarks need (``workloads``, ``driver``,
``reference``, ``shims``, ``bench``). They import vLLM only when used."""
