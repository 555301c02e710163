"""mtpstate: batched request state for LLM serving engines.

Data flow: scheduler output -> validation + kernels (``RequestTable.apply``)
-> host arrays -> staging -> device tensors (``mirror``).
"""

from __future__ import annotations

import importlib

__version__ = "0.4.0"

# The public names, imported on first use (PEP 562): importing mtpstate (as
# vLLM's plugin loader does in every process) loads neither numpy nor numba
_LAZY = {
    "CapacityError": "mtpstate.errors",
    "DuplicateRequestError": "mtpstate.errors",
    "InvalidStepError": "mtpstate.errors",
    "MirrorFaultError": "mtpstate.errors",
    "StateError": "mtpstate.errors",
    "UnknownRequestError": "mtpstate.errors",
    "RequestIndex": "mtpstate.index",
    "StepResult": "mtpstate.results",
    "RequestTable": "mtpstate.table",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mtpstate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def warmup() -> float:
    """Compile (or load from numba's on-disk cache) every kernel now, so that
    no JIT compilation lands on the first scheduler step. Returns seconds
    spent."""
    import time
    from types import SimpleNamespace as NS

    from mtpstate.index import RequestIndex
    from mtpstate.table import RequestTable

    t0 = time.perf_counter()
    t = RequestTable(max_num_reqs=4, max_model_len=32, block_sizes=[16])
    none = NS(req_ids=[], num_computed_tokens=[], new_block_ids=[])
    new = NS(
        req_id="w",
        prompt_token_ids=[1, 2],
        prefill_token_ids=None,
        sampling_params=NS(max_tokens=4),
        block_ids=([0],),
        num_computed_tokens=0,
    )
    t.apply(NS(finished_req_ids=set(), preempted_req_ids=None, scheduled_new_reqs=[new], scheduled_cached_reqs=none))
    cached = NS(req_ids=["w"], num_computed_tokens=[2], new_block_ids=[([1],)])
    t.apply(NS(finished_req_ids=set(), preempted_req_ids=None, scheduled_new_reqs=[], scheduled_cached_reqs=cached))
    t.apply(NS(finished_req_ids={"w"}, preempted_req_ids=None, scheduled_new_reqs=[], scheduled_cached_reqs=none))
    ix = RequestIndex(2)
    ix.insert(["w"])
    ix.lookup(["w"])
    ix.remove(["w"])
    return time.perf_counter() - t0


__all__ = [
    "CapacityError",
    "DuplicateRequestError",
    "InvalidStepError",
    "MirrorFaultError",
    "RequestIndex",
    "RequestTable",
    "StateError",
    "StepResult",
    "UnknownRequestError",
    "__version__",
    "warmup",
]
