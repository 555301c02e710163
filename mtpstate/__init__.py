"""mtpstate: batched request state for LLM serving engines.

Data flow: scheduler output -> validation + kernels (``RequestTable.apply``)
-> host arrays -> staging -> device tensors (``mirror``).
"""

from mtpstate.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidStepError,
    StateError,
    UnknownRequestError,
)
from mtpstate.index import RequestIndex
from mtpstate.table import RequestTable, StepResult

__version__ = "0.1.0"


def warmup() -> float:
    """Compile (or load from numba's on-disk cache) every kernel now, so that
    no JIT compilation lands on the first scheduler step. Returns seconds
    spent."""
    import time

    from mtpstate.sim import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

    t0 = time.perf_counter()
    t = RequestTable(max_num_reqs=4, max_model_len=32, block_sizes=[16])
    new = NewRequestData("w", [1, 2], SamplingParams(4), ([0],), 0)
    t.apply(SchedulerOutput(scheduled_new_reqs=[new]))
    t.apply(SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["w"], set(), [[]], [([1],)], [2], [0])))
    t.apply(SchedulerOutput(finished_req_ids={"w"}))
    ix = RequestIndex(2)
    ix.insert(["w"])
    ix.lookup(["w"])
    ix.remove(["w"])
    return time.perf_counter() - t0


__all__ = [
    "CapacityError",
    "DuplicateRequestError",
    "InvalidStepError",
    "RequestIndex",
    "RequestTable",
    "StateError",
    "StepResult",
    "UnknownRequestError",
    "__version__",
    "warmup",
]
