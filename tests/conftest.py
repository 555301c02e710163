import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", deadline=None, max_examples=600, suppress_health_check=[HealthCheck.too_slow])
# CI: the same examples every run, so a landing is never decided by the draw
# (make test-slow explores at random with 10x the examples)
settings.register_profile(
    "ci", deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


def index_snapshot(ix):
    """Every array the index is made of, copied (error slots of the context
    excluded: they are scratch)."""
    from mtpstate._kernels import slots as T

    ctx = ix._ctx.copy()
    ctx[T.IX_ERR_POS : T.IX_ERR_PHASE + 1] = 0
    return [ix._slots.copy(), ix._row_hash.copy(), ix._keys.copy(), ix._key_len.copy(), ctx]


def assert_same_arrays(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def snapshot():
    return index_snapshot
