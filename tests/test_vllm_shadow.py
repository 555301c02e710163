"""Shadow mode's wiring, without vLLM (its comparisons run in the vLLM tier,
vllm_proof/test_shadow.py): what ``VLLM_USE_MTPSTATE`` asks for, the
settings, and that the wrappers on a runner class return exactly what
vLLM's methods return and never raise, whatever the shadow meets."""

import logging
import types

import pytest

from mtpstate.integrations.vllm import plugin, shadow


@pytest.mark.parametrize(
    "value, mode",
    [
        (None, "off"),
        ("0", "off"),
        ("1", "on"),
        (" 1 ", "on"),
        ("shadow", "shadow"),
        ("SHADOW", "shadow"),
        ("yes", "off"),
    ],
)
def test_mode(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(plugin.ENV_VAR, value)
    assert plugin.mode() == mode
    assert plugin.enabled() == (mode == "on")


@pytest.mark.parametrize("value, want, warned", [(None, 16, False), ("4", 4, False), ("0", 16, True), ("x", 16, True)])
def test_setting(monkeypatch, caplog, value, want, warned):
    if value is None:
        monkeypatch.delenv(shadow.EVERY_VAR, raising=False)
    else:
        monkeypatch.setenv(shadow.EVERY_VAR, value)
    with caplog.at_level(logging.WARNING, logger="vllm.mtpstate"):
        assert shadow.setting(shadow.EVERY_VAR, shadow.DEFAULT_EVERY) == want
    assert any(shadow.EVERY_VAR in r.getMessage() for r in caplog.records) == warned


def _runner_module():
    """A module whose GPUModelRunner has the four methods shadow mode observes."""

    class GPUModelRunner:
        def initialize_kv_cache(self, config):
            self.req_states = types.SimpleNamespace(req_id_to_index={})
            self.block_tables = object()
            self.decode_query_len = 1
            return ("kv", config)

        def add_requests(self, so):
            return ("added", so)

        def update_requests(self, so):
            return ("updated", so)

        def prepare_inputs(self, so, batch, desc, loras):
            return ("inputs", so, batch, desc, loras)

    m = types.ModuleType("fake_runner_module")
    m.GPUModelRunner = GPUModelRunner
    return m


@pytest.fixture
def restore_shadow_globals():
    saved = (dict(shadow._METHODS), list(shadow._CLASS), shadow._OPS)
    yield
    shadow._METHODS.clear()
    shadow._METHODS.update(saved[0])
    shadow._CLASS[:] = saved[1]
    shadow._OPS = saved[2]


def test_wrappers_return_vllms_results_and_never_raise(restore_shadow_globals, caplog):
    """The shadow cannot be built here (its runner is not vLLM's): vLLM's
    methods still run and return what they return, one WARNING says why,
    and installing twice wraps once."""
    m = _runner_module()
    originals = dict(vars(m.GPUModelRunner))
    shadow.install(m, {})
    shadow.install(m, {})
    R = m.GPUModelRunner
    for name in shadow._OBSERVED:
        fn = vars(R)[name]
        assert getattr(fn, "__mtpstate_shadow__", False) and fn.__wrapped__ is originals[name]
    r = R()
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        assert r.add_requests("so") == ("added", "so")  # (not initialized: no shadow yet, asked again later)
        assert r.initialize_kv_cache("cfg") == ("kv", "cfg")
        assert r.add_requests("so") == ("added", "so")
        assert r.update_requests("so") == ("updated", "so")
        assert r.prepare_inputs("so", "b", "d", 0) == ("inputs", "so", "b", "d", 0)
    warnings = [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "could not be set up" in warnings[0], warnings
    assert shadow.shadow_of(r) is None


def test_a_runner_class_without_an_observed_method_is_left_alone(restore_shadow_globals):
    m = _runner_module()
    del m.GPUModelRunner.prepare_inputs
    before = dict(vars(m.GPUModelRunner))
    with pytest.raises(TypeError, match="prepare_inputs"):
        shadow.install(m, {})
    assert dict(vars(m.GPUModelRunner)) == before


def test_a_shadow_that_fails_stops_with_one_warning(restore_shadow_globals, caplog):
    """An exception of the shadow's own, in any hook, ends it with one
    WARNING; vLLM's results are unchanged and later steps skip the shadow."""
    m = _runner_module()
    shadow.install(m, {})
    r = m.GPUModelRunner()
    calls = []

    class Failing(shadow.Shadow):
        def __init__(self):
            self.active, self.steps, self.stopped, self.runner = True, 0, None, object()
            self._pending, self._seeded = [], []

        def before_add(self, so):
            calls.append("before_add")

        def after_update(self, so):
            calls.append("after_update")
            raise KeyError("boom")

    r.__dict__[shadow._ATTR] = Failing()
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        assert r.add_requests("so") == ("added", "so")
        assert r.update_requests("so") == ("updated", "so")
        assert r.add_requests("so2") == ("added", "so2")
        assert r.update_requests("so2") == ("updated", "so2")
    assert calls == ["before_add", "after_update"]
    warnings = [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "stopped at step 1 in update_requests: KeyError" in warnings[0], warnings
    assert "an error of the shadow's own" in warnings[0]
    sh = r.__dict__[shadow._ATTR]
    assert not sh.active and sh.runner is None and shadow.shadow_of(r) is None
