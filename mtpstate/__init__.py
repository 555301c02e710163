"""mtpstate: batched request state for LLM serving engines."""

from mtpstate.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidStepError,
    StateError,
    UnknownRequestError,
)
from mtpstate.index import RequestIndex

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "DuplicateRequestError",
    "InvalidStepError",
    "RequestIndex",
    "StateError",
    "UnknownRequestError",
    "__version__",
]
