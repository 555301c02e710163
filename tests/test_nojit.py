"""The kernels run as plain Python under NUMBA_DISABLE_JIT=1 (``make test``
runs this file that way), so their code and the ctypes fallbacks of the
low-level primitives are exercised and covered too."""

import pytest
from test_index import (  # noqa: F401
    test_forced_collisions_never_return_another_row,
    test_generic_inputs_and_fresh_strings,
    test_ids_that_differ_past_the_first_word_and_in_length,
    test_rejected_calls_change_nothing,
)

from mtpstate._native import JIT_DISABLED

pytestmark = pytest.mark.skipif(not JIT_DISABLED, reason="collected again by `make test` under NUMBA_DISABLE_JIT=1")


def test_jit_is_disabled():
    from mtpstate import _kernels

    assert not hasattr(_kernels.ix_find, "signatures")
