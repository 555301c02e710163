import pickle
import re

import pytest

SIZES = [1, 16, 256, 1024, 4096, 16384]


def make_ids(n, start=0):
    return [f"cmpl-{i:032x}-0" for i in range(start, start + n)]


class FreshIds:
    """Each call returns freshly unpickled id strings (hash not cached), as a
    worker process receives them from the scheduler every step."""

    def __init__(self, ids, pool=64):
        blob = pickle.dumps(ids)
        self._lists = [pickle.loads(blob) for _ in range(pool)]
        self._i = 0

    def __call__(self):
        self._i = (self._i + 1) % len(self._lists)
        return self._lists[self._i]


@pytest.fixture
def fresh_ids():
    return FreshIds


def natural_key(name):
    """'apply-mixed-N16' before 'apply-mixed-N1024': digit runs compare as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name or "")]


@pytest.hookimpl(hookwrapper=True)
def pytest_benchmark_group_stats(config, benchmarks, group_by):
    """Groups in numeric order of N (pytest-benchmark sorts their names as text)."""
    outcome = yield
    outcome.force_result(sorted(outcome.get_result(), key=lambda pair: natural_key(pair[0])))
