"""Batched id -> row lookup: RequestIndex against the dict it replaces.

Run: ``pytest benchmarks -k index`` (``--benchmark-disable`` for a smoke run).
"""

import numpy as np
import pytest
from conftest import SIZES, FreshIds, make_ids

from mtpstate import RequestIndex


@pytest.mark.parametrize("fresh", [False, True], ids=["cached-hash", "fresh"])
@pytest.mark.parametrize("impl", ["dict", "index"])
@pytest.mark.parametrize("n", SIZES)
def test_index_lookup(benchmark, n, impl, fresh):
    benchmark.group = f"index-lookup-{'fresh' if fresh else 'cached'}-N{n}"
    ids = make_ids(n)
    source = FreshIds(ids) if fresh else (lambda: ids)
    if impl == "dict":
        d = {k: i for i, k in enumerate(ids)}
        get = d.__getitem__

        def run():
            return np.fromiter(map(get, source()), np.int64, n)

    else:
        ix = RequestIndex(n)
        ix.insert(ids)
        run = lambda: ix.lookup(source())  # noqa: E731
    rows = benchmark(run)
    assert rows.tolist() == list(range(n))


@pytest.mark.parametrize("n", [16, 1024])
def test_quick_index_smoke(benchmark, n):
    ix = RequestIndex(n)
    ids = make_ids(n)
    ix.insert(ids)
    assert benchmark(ix.lookup, ids).tolist() == list(range(n))
