"""Tools for perf engineers, outside the core: the scheduler simulator
(``sim``), trace files (``trace``) and replay (``replay``), benchmark
workloads (``workloads``), the per-request loop references (``reference``),
the benchmark driver (``bench``) and the command line (``cli``)."""
