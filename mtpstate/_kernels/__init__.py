"""numba kernels, private, one concern per module.

Data flow of a step: ``jit`` (the decorator options) and ``native`` (loads,
stores and CPython C-API calls as numba intrinsics) under ``pyobjects``
(Python objects read in place: ids, lists, ints, vectors, dicts), which
every kernel calls into; ``status`` and ``slots`` (what a kernel reports,
and the named slots of its contexts); then ``step`` (the step kernel, phase
by phase) with ``index`` (the request id -> row hash index),
``new_requests`` (a step's new requests read, validated, written),
``writes`` (element writes staged for the mirror) and ``batch`` (the step's
batch); ``arrays`` is the array entry point. For an engine's sampler:
``sampling_params`` (new requests' params read in place and written into
its per-row arrays) and ``sampler`` (its per-step answers over a batch). The Python API
(``mtpstate.index``, ``mtpstate.table``) launches them with integer
arguments only.
"""
