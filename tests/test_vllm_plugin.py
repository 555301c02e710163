"""The vLLM plugin's machinery on a small stand-in for vLLM (a package named
``vllm`` in a temporary directory, with its own patch and fingerprints), so
that it runs in ``make test`` without vLLM: the in-memory patch, the guard,
all-or-nothing application, the import hook, idempotence, the switch.
``make test-vllm`` checks the same on vLLM 0.34.0 itself."""

import importlib
import logging
import sys
import textwrap

import pytest

from mtpstate.integrations.vllm import _source, plugin

RUNNER = """\
import math


class GPUModelRunner:
    def __init__(self):
        self.steps = 0

    def finish_requests(self, so):
        return sorted(so)

    def add_requests(self, so):
        self.steps += 1
        return math.floor(self.steps)


def helper():
    return 1
"""

# a function whose results mtpstate computes in its place (plugin.COMPUTED)
COMPUTED = """\
def expand(rows, counts):
    return [r for r, k in zip(rows, counts) for _ in range(k)]
"""

PATCH = """\
--- a/vllm/v1/worker/gpu/model_runner.py
+++ b/vllm/v1/worker/gpu/model_runner.py
@@ -1,4 +1,5 @@
 import math
+import os


 class GPUModelRunner:
@@ -10,7 +11,9 @@

     def add_requests(self, so):
         self.steps += 1
-        return math.floor(self.steps)
+        if getattr(self, "mtpstate", None) is not None:
+            return "mtpstate"
+        return math.floor(self.steps) + len(os.sep) * 0


 def helper():
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A package ``vllm`` 9.9.9 whose runner module is RUNNER, with PATCH as
    mtpstate's patch and its fingerprint as the supported one."""
    gpu = tmp_path / "vllm" / "v1" / "worker" / "gpu"
    gpu.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "v1", tmp_path / "vllm" / "v1" / "worker", gpu):
        (d / "__init__.py").write_text("")
    (tmp_path / "vllm" / "version.py").write_text("__version__ = '9.9.9'\n")
    (gpu / "model_runner.py").write_text(RUNNER)
    (gpu / "input_batch.py").write_text(COMPUTED)
    (fp,) = _source.fingerprints(RUNNER, [("GPUModelRunner", "add_requests")]).values()
    monkeypatch.setattr(plugin, "SUPPORTED", {"9.9.9": {"GPUModelRunner.add_requests": fp}})
    computed = _source.function_fingerprints(COMPUTED, ["expand"])
    monkeypatch.setattr(plugin, "COMPUTED", {"9.9.9": {"vllm.v1.worker.gpu.input_batch": computed}})
    monkeypatch.setattr(plugin, "_patch_text", lambda release: PATCH)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    importlib.invalidate_caches()
    yield gpu / "model_runner.py"
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def _runner_module():
    return importlib.import_module(plugin.RUNNER_MODULE)


def test_apply_diff_is_exact():
    hunks = _source.split_diff(PATCH)["vllm/v1/worker/gpu/model_runner.py"]
    text, changed = _source.apply_diff(RUNNER, hunks)
    assert "import os" in text and 'return "mtpstate"' in text
    assert ("del", 13) in changed and ("ins", 1) in changed
    with pytest.raises(_source.DiffError, match="does not apply"):
        _source.apply_diff(RUNNER.replace("self.steps += 1", "self.steps += 2"), hunks)
    # shifted by lines above: found where it matches once
    shifted, _ = _source.apply_diff("# a comment\n" + RUNNER, hunks)
    assert shifted == "# a comment\n" + text


@pytest.mark.parametrize(
    "edit, error",
    [
        ("def helper():\n    return 1", "outside the methods"),  # a module-level function changed
        ("    def __init__(self):", "new method"),  # a method added
        ("super()", "super()"),
    ],
)
def test_plan_refuses_what_cannot_be_applied_live(edit, error):
    if edit.startswith("def helper"):
        new = RUNNER.replace("    return 1\n", "    return 2\n")
    elif edit.startswith("    def __init__"):
        new = RUNNER.replace(edit, "    def extra(self):\n        pass\n\n" + edit)
    else:
        new = RUNNER.replace("return sorted(so)", "return super().finish_requests(so)")
    diff = _unified(RUNNER, new)
    with pytest.raises(_source.DiffError, match=error.replace("(", r"\(").replace(")", r"\)")):
        _source.plan(plugin.RUNNER_MODULE, RUNNER, _source.split_diff(diff)["vllm/v1/worker/gpu/model_runner.py"])


def _unified(a, b):
    import difflib

    lines = difflib.unified_diff(
        a.splitlines(),
        b.splitlines(),
        "a/vllm/v1/worker/gpu/model_runner.py",
        "b/vllm/v1/worker/gpu/model_runner.py",
        lineterm="",
    )
    return "\n".join(lines) + "\n"


def test_disabled_does_nothing(fake_vllm, monkeypatch, caplog):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        plugin.register()
        m = _runner_module()
    assert not any(isinstance(f, plugin._PatchOnImport) for f in sys.meta_path)
    assert m.GPUModelRunner().add_requests(None) == 1
    assert {r.levelno for r in caplog.records} <= {logging.DEBUG}


def test_enabled_patches_on_first_import_once(fake_vllm, monkeypatch, caplog):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        plugin.register()
        plugin.register()  # vLLM may load plugins several times
        assert sum(isinstance(f, plugin._PatchOnImport) for f in sys.meta_path) == 1
        assert plugin.RUNNER_MODULE not in sys.modules  # nothing imported yet
        m = _runner_module()
        plugin.register()
    R = m.GPUModelRunner
    r = R()
    assert r.add_requests(None) == 1  # no mtpstate on this runner: the original path
    r.mtpstate = object()
    assert r.add_requests(None) == "mtpstate"
    assert R.add_requests.__qualname__ == "GPUModelRunner.add_requests"
    original = R.add_requests.__mtpstate_original__
    assert not getattr(original, "__mtpstate_patched__", False)  # applied once, not on top of itself
    assert m.os is __import__("os")  # the patch's new import
    assert R.finish_requests.__code__.co_filename == str(fake_vllm)  # untouched
    assert plugin.check(m).applied
    assert {r.levelno for r in caplog.records} <= {logging.DEBUG}
    # the traceback of a patched method shows the patched line
    r.mtpstate = None
    r.steps = "x"
    with pytest.raises(TypeError) as e:
        r.add_requests(None)
    assert "self.steps += 1" in str(e.traceback[-1])


def _assert_refused(m, caplog, needle):
    before, module_before = dict(vars(m.GPUModelRunner)), dict(vars(m))
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        v = plugin.apply(m)
    assert not v.ok and not v.applied
    assert dict(vars(m.GPUModelRunner)) == before and dict(vars(m)) == module_before
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and needle in warnings[0] and "mtpstate vllm-check" in warnings[0]


def test_drifted_method_changes_nothing(fake_vllm, monkeypatch, caplog):
    fake_vllm.write_text(RUNNER.replace("self.steps += 1", "self.steps += 1  # drift"))
    _assert_refused(_runner_module(), caplog, "GPUModelRunner.add_requests: differs")


def test_drifted_computed_function_changes_nothing(fake_vllm, monkeypatch, caplog):
    """A vLLM function whose results mtpstate computes (here its kernel
    would write something else) refuses the patch as a changed method does."""
    (fake_vllm.parent / "input_batch.py").write_text(COMPUTED.replace("range(k)", "range(k + 1)"))
    _assert_refused(_runner_module(), caplog, "input_batch.expand: differs")


def test_missing_computed_function_changes_nothing(fake_vllm, monkeypatch, caplog):
    (fake_vllm.parent / "input_batch.py").write_text("")
    _assert_refused(_runner_module(), caplog, "input_batch.expand: missing in the source")


def test_unsupported_version_changes_nothing(fake_vllm, monkeypatch, caplog):
    (fake_vllm.parents[3] / "version.py").write_text("__version__ = '9.9.10'\n")
    _assert_refused(_runner_module(), caplog, "9.9.10 is not a supported version")


def test_method_replaced_by_others_changes_nothing(fake_vllm, monkeypatch, caplog):
    m = _runner_module()
    monkeypatch.setattr(m.GPUModelRunner, "add_requests", lambda self, so: 0)
    _assert_refused(m, caplog, "replaced at run time")


def test_source_already_patched_changes_nothing(fake_vllm, monkeypatch, caplog):
    text, _ = _source.apply_diff(RUNNER, _source.split_diff(PATCH)["vllm/v1/worker/gpu/model_runner.py"])
    fake_vllm.write_text(text.replace('"mtpstate"', '"VLLM_USE_MTPSTATE"'))
    _assert_refused(_runner_module(), caplog, "already carries mtpstate's patch")


def test_a_failure_while_applying_leaves_vllm_as_it_was(fake_vllm, monkeypatch, caplog):
    """A bug of ours (here: compiling fails) is logged; nothing is changed."""
    monkeypatch.setenv(plugin.ENV_VAR, "1")

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(_source, "compile_method", broken)
    plugin.register()
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        m = _runner_module()
    assert m.GPUModelRunner().add_requests(None) == 1 and not hasattr(m, "os")
    assert any("failed while applying" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_plugin_imports_no_vllm():
    import subprocess

    code = textwrap.dedent(
        """
        import sys
        import mtpstate.integrations.vllm.plugin as p
        p.register()
        assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != plugin.ENV_VAR}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_nearest_supported_release():
    newest = max(plugin.SUPPORTED, key=plugin._version_key)
    oldest = min(plugin.SUPPORTED, key=plugin._version_key)
    assert plugin.nearest_release(None) == newest
    assert plugin.nearest_release("99.0.0") == newest
    assert plugin.nearest_release("0.0.1") == oldest
    assert plugin.nearest_release(newest + "+cu129") == newest


def test_drift_names_each_changed_definition_from_source_text():
    """plugin.drift reads source text only: every definition is named, a
    stand-in differs, a definition gone is missing, a module that cannot
    be read says so (the same verdicts as the guard's)."""
    release = max(plugin.SUPPORTED, key=plugin._version_key)
    table = plugin.definitions(release)
    gone_mod, lost_mod = "vllm.v1.worker.gpu.input_batch", "vllm.sampling_params"

    def read(module):
        if module == lost_mod:
            raise FileNotFoundError(module)
        classes, lines = {}, []
        for name in table[module]:
            cls, _, meth = name.rpartition(".")
            if module == gone_mod and name == "expand_idx_mapping":
                continue
            if cls:
                classes.setdefault(cls, []).append(f"    def {meth}(self):\n        pass")
            else:
                lines.append(f"def {meth}():\n    pass")
        lines += [f"class {cls}:\n" + "\n".join(defs) for cls, defs in classes.items()]
        return "\n\n".join(lines) + "\n"

    got = plugin.drift(read, release)
    assert set(got) == {f"{m}:{n}" for m, names in table.items() for n in names}
    assert got[f"{gone_mod}:expand_idx_mapping"] == "missing in the source"
    assert all(v.startswith("its source cannot be read") for k, v in got.items() if k.startswith(lost_mod + ":"))
    # (every definition here is a stand-in: all differ from vLLM's, but none is reported missing wrongly)
    assert all(
        v.startswith("differs from vLLM")
        for k, v in got.items()
        if not k.startswith((lost_mod, gone_mod + ":expand_idx_mapping"))
    )


def test_shadow_refused_by_the_guard_changes_nothing(fake_vllm, monkeypatch, caplog):
    """VLLM_USE_MTPSTATE=shadow takes the same guard: on a vLLM it was not
    written for, one WARNING and nothing set up."""
    (fake_vllm.parents[3] / "version.py").write_text("__version__ = '9.9.10'\n")
    monkeypatch.setenv(plugin.ENV_VAR, "shadow")
    m = _runner_module()
    before = dict(vars(m.GPUModelRunner))
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        v = plugin.shadow(m)
    assert not v.ok and dict(vars(m.GPUModelRunner)) == before and not hasattr(m, "os")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "=shadow, but the shadow is not set up" in warnings[0]
    assert "9.9.10 is not a supported version" in warnings[0]


def test_shadow_on_import_compiles_nothing_into_vllms_module(fake_vllm, monkeypatch, caplog):
    """With the guard passing, shadow mode never applies the patch: here the
    runner lacks a method the shadow observes, so it is left as it was (an
    ERROR, vLLM runs on), and the patch's import did not reach the module."""
    monkeypatch.setenv(plugin.ENV_VAR, "shadow")
    plugin.register()
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        m = _runner_module()
    R = m.GPUModelRunner
    assert R().add_requests(None) == 1 and not hasattr(m, "os")
    assert not getattr(vars(R)["add_requests"], "__mtpstate_shadow__", False)
    assert not plugin.check(m).applied
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "failed while applying" in errors[0]


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_entry_point_not_asked_for_imports_only_the_standard_library(value):
    # vLLM loads every general plugin in every process, asked for or not:
    # until VLLM_USE_MTPSTATE asks, loading the entry point (as vLLM's
    # loader does: the module, then register()) brings in nothing but the
    # standard library and mtpstate's own modules; no numpy, no numba
    import os
    import subprocess
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "mtpstate"]
    code = textwrap.dedent(
        f"""
        import sys
        from importlib.metadata import entry_points
        before = set(sys.modules)
        (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.value == {ep.value!r}]
        ep.load()()
        new = set(sys.modules) - before
        top = {{m.split(".")[0] for m in new}}
        assert "mtpstate" in top, top
        print(sorted(t for t in top - {{"mtpstate"}} if t not in sys.stdlib_module_names))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != plugin.ENV_VAR}
    if value is not None:
        env[plugin.ENV_VAR] = value
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
