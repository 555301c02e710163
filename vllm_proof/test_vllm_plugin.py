"""`make test-vllm`, the plugin's guard on the tier's vLLM release's real source: the
fingerprint table matches the patch and the release; any drift (a changed
method, another version, a method replaced at run time, a patch that does not
apply) changes nothing and says so in one WARNING; without the variable the
plugin does nothing; loading it again changes nothing more; the plugin and
the patch are one text."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest

from mtpstate.integrations.vllm import _source, plugin

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ["PYTHONPATH"].split(os.pathsep)[0]
RUNNER_FILE = os.path.join(SRC, "vllm", "v1", "worker", "gpu", "model_runner.py")
PATCHED = os.environ.get("MTPSTATE_VLLM_PATCHED")
RELEASE = plugin.installed_release()  # the tier's release (its source is SRC)


@pytest.fixture(scope="module")
def runner_module():
    import vllm.v1.worker.gpu.model_runner as m

    assert not plugin.check(m).applied  # this process runs vLLM's own code
    return m


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _methods(cls):
    return {k: v for k, v in vars(cls).items() if callable(v)}


def test_fingerprints_are_the_patch_against_the_release():
    change = _source.plan(
        plugin.RUNNER_MODULE,
        _read(RUNNER_FILE),
        _source.split_diff(plugin._patch_text(RELEASE))["vllm/v1/worker/gpu/model_runner.py"],
    )
    table = {f"{c}.{m}": fp for (c, m), fp in change.originals.items()}
    assert table == plugin.SUPPORTED[RELEASE]


def test_guard_passes_on_the_release(runner_module):
    v = plugin.check(runner_module)
    assert v.ok and not v.applied, v.problems
    assert v.vllm_version == RELEASE
    assert set(v.methods) == set(plugin.SUPPORTED[RELEASE]) and all(m == "ok" for m in v.methods.values())
    # the functions mtpstate computes in vLLM's place are the release's
    want = {f"{mod.rsplit('.', 1)[1]}.{f}" for mod, fs in plugin.COMPUTED[RELEASE].items() for f in fs}
    assert want and v.computed == dict.fromkeys(want, "ok"), v.computed


@pytest.mark.skipif(not PATCHED, reason="run through `make test-vllm` (it applies the patch)")
def test_plugin_and_patch_are_one_text(runner_module):
    """What the plugin compiles is the patched tree's model_runner.py, line for line."""
    v = plugin.check(runner_module)
    assert v.change.patched_text == _read(os.path.join(PATCHED, "vllm", "v1", "worker", "gpu", "model_runner.py"))


def _drifted_module(runner_module, tmp_path, text):
    path = tmp_path / "model_runner.py"
    path.write_text(text)
    fake = types.ModuleType(plugin.RUNNER_MODULE)
    fake.__file__ = str(path)
    fake.GPUModelRunner = runner_module.GPUModelRunner
    return fake


def _refused(module, caplog):
    cls = module.GPUModelRunner
    before = _methods(cls)
    with caplog.at_level(logging.DEBUG, logger="vllm.mtpstate"):
        v = plugin.apply(module)
    assert not v.ok and not v.applied
    assert _methods(cls) == before  # nothing at all changed
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not applied" in warnings[0].getMessage()
    return v, warnings[0].getMessage()


def test_changed_method_refused(runner_module, tmp_path, caplog):
    text = _read(RUNNER_FILE).replace(
        "        # Update CPU num_computed_prefill_tokens.\n", "        # Update the CPU prefill counter.\n"
    )
    v, msg = _refused(_drifted_module(runner_module, tmp_path, text), caplog)
    assert any(k == "GPUModelRunner.update_requests" and "fingerprint" in m for k, m in v.methods.items())
    # the others are the release's (here defined in another file than the drifted copy)
    assert [k for k, m in v.methods.items() if "differs" in m] == ["GPUModelRunner.update_requests"]
    assert "update_requests" in msg and "mtpstate vllm-check" in msg


def test_patch_that_does_not_apply_refused(runner_module, tmp_path, caplog):
    text = _read(RUNNER_FILE).replace("import gc\nimport time\n", "import gc\nimport sys\nimport time\n")
    v, msg = _refused(_drifted_module(runner_module, tmp_path, text), caplog)
    assert "does not apply" in msg


def test_other_version_refused(runner_module, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_version", lambda: "0.35.0")
    v, msg = _refused(runner_module, caplog)
    assert "0.35.0 is not a supported version" in msg


def test_method_replaced_at_run_time_refused(runner_module, monkeypatch, caplog):
    monkeypatch.setattr(runner_module.GPUModelRunner, "add_requests", lambda self, so: None)
    v, msg = _refused(runner_module, caplog)
    assert "replaced at run time" in v.methods["GPUModelRunner.add_requests"]


def _run(code, env_on):
    env = dict(os.environ)
    env.pop("VLLM_USE_MTPSTATE", None)
    if env_on:
        env["VLLM_USE_MTPSTATE"] = "1"
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


# the subprocesses keep every record of mtpstate's logger
_KEEP_RECORDS = """
    import logging, sys
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    log = logging.getLogger("vllm.mtpstate")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
"""

_LOAD = (
    _KEEP_RECORDS
    + """
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    hooks = sum(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)
    lazy = "vllm.v1.worker.gpu.model_runner" not in sys.modules
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as R
    from mtpstate.integrations.vllm import plugin
    plugin.register(); plugin.register()  # vLLM may load plugins several times
    patched = [k for k, v in vars(R).items() if getattr(v, "__mtpstate_patched__", False)]
    originals = [getattr(v, "__mtpstate_original__", None) for v in vars(R).values()]
    nested = [o for o in originals if getattr(o, "__mtpstate_patched__", False)]
    print("RESULT", hooks, lazy, sorted(patched), len(nested), plugin.check().applied)
    print("LOGGED", sorted({r.levelname for r in records}))
"""
)


def _lines(p, tag):
    return [ln for ln in p.stdout.splitlines() if ln.startswith(tag)][0]


def test_disabled_changes_nothing(runner_module):
    p = _run(_LOAD, env_on=False)
    assert _lines(p, "RESULT") == "RESULT 0 True [] 0 False"
    assert _lines(p, "LOGGED") == "LOGGED ['DEBUG']"  # nothing above DEBUG


def test_enabled_applies_once_on_first_import(runner_module):
    p = _run(_LOAD, env_on=True)
    result = _lines(p, "RESULT")
    names = sorted(k.split(".")[1] for k in plugin.SUPPORTED[RELEASE])
    # one import hook; the runner module patched when first imported; loading
    # again patched nothing more (no patched method wraps another)
    assert result == f"RESULT 1 True {names} 0 True"
    assert _lines(p, "LOGGED") == "LOGGED ['DEBUG']"  # applied quietly; the INFO line comes with a runner


@pytest.mark.parametrize(
    "env, rc, needle",
    [
        ({}, 0, "VLLM_USE_MTPSTATE=1 would: apply mtpstate"),
        ({"VLLM_PLUGINS": "other"}, 1, "VLLM_PLUGINS='other' leaves out 'mtpstate'"),
        ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, 1, "VLLM_USE_V2_MODEL_RUNNER=0 asks vLLM for Model Runner V1"),
    ],
)
def test_vllm_check(env, rc, needle):
    """The operator's check in vLLM's environment: exit 0 only when the
    integration would apply; one line per fact, no traceback; --json."""
    full = dict(os.environ, **env)
    p = subprocess.run([sys.executable, "-m", "mtpstate", "vllm-check"], capture_output=True, text=True, env=full)
    assert p.returncode == rc and "Traceback" not in p.stderr, p.stdout + p.stderr[-2000:]
    assert needle in p.stdout and f"vLLM: {RELEASE}, supported" in p.stdout
    assert p.stdout.count("guard: GPUModelRunner.") == len(plugin.SUPPORTED[RELEASE])
    assert p.stdout.count("guard (computed by mtpstate): input_batch.") == 2
    n_sampler = sum(len(v) for v in plugin.SAMPLER_COMPUTED[RELEASE].values())
    assert p.stdout.count("guard (sampler, answered by mtpstate): ") == n_sampler
    sampler_lines = [ln for ln in p.stdout.splitlines() if ln.startswith("guard (sampler")]
    assert all(ln.endswith(": ok") for ln in sampler_lines), sampler_lines
    p = subprocess.run([sys.executable, "-m", "mtpstate", "vllm-check", "--json"], capture_output=True, env=full)
    assert p.returncode == rc and json.loads(p.stdout)["would_apply"] is (rc == 0)


_RUNNERS = (
    _KEEP_RECORDS
    + """
    sys.path.insert(0, {here!r})
    from mtpstate.tools.vllm_bench.reference import MRV2Reference, load_plugin
    from mtpstate.tools.vllm_bench.shims import install_cpu_shims
    install_cpu_shims()
    load_plugin()
    runners = [MRV2Reference(8, 256, 64, [16], 1, use_mtpstate=True) for _ in range(2)]
    odd = MRV2Reference(8, 256, 64, [16], 1)
    odd.pcp_manager = object()
    from mtpstate.integrations.vllm import ModelRunnerV2State
    assert ModelRunnerV2State.for_runner(odd) is None and ModelRunnerV2State.for_runner(odd) is None
    assert all(r.mtpstate is not None for r in runners)
    for r in records:
        print("LOG", r.levelname, r.getMessage())
"""
)


def test_one_info_line_per_process():
    """A worker says once that mtpstate is active (table size, ring depth),
    and once per reason that a runner keeps vLLM's own state."""
    p = _run(_RUNNERS.format(here=HERE), env_on=False)
    logged = [ln for ln in p.stdout.splitlines() if ln.startswith("LOG") and not ln.startswith("LOG DEBUG")]
    assert len(logged) == 2, logged
    assert logged[0].startswith("LOG INFO mtpstate: active;") and "max_num_reqs=8" in logged[0]
    assert "ring depth 2" in logged[0]
    assert logged[1] == (
        "LOG INFO mtpstate: not used for prefill context parallelism (PCP); this runner keeps vLLM's own request state"
    )


_SAMPLER = (
    _KEEP_RECORDS
    + """
    sys.path.insert(0, {here!r})
    from mtpstate.tools.vllm_bench.reference import MRV2Reference, load_plugin
    from mtpstate.tools.vllm_bench.shims import install_cpu_shims
    install_cpu_shims()
    load_plugin()
    from mtpstate.integrations.vllm import plugin
    if {drift!r}:
        table = plugin.SAMPLER_COMPUTED[plugin.installed_release()]["vllm.v1.worker.gpu.sample.states"]
        table["SamplingStates.any_greedy"] = "0000000000000000"
    print("BAD", sorted(k for k, m in plugin.check_sampler(refresh=True).items() if m != "ok"))
    r = MRV2Reference(8, 256, 64, [16], 1, use_mtpstate=True, sampler=True)
    ss = r.sampler.sampling_states
    on = r.mtpstate.sampler_answers is not None
    print("ATTACHED", on, "any_greedy" in vars(ss), "add_request" in vars(r.sampler))
    for rec in records:
        print("LOG", rec.levelname, rec.getMessage())
"""
)


@pytest.mark.parametrize("drift", [False, True])
def test_sampler_guard(drift):
    """mtpstate answers vLLM's sampler questions only when every method it
    replaces is vLLM 0.34.0's own (fingerprints); a changed one leaves the
    sampler untouched (no instance attribute set), says so once, and the
    rest of the integration still applies."""
    p = _run(_SAMPLER.format(here=HERE, drift=drift), env_on=False)
    assert p.returncode == 0, p.stderr[-3000:]
    bad = _lines(p, "BAD")
    attached = _lines(p, "ATTACHED")
    logs = [ln for ln in p.stdout.splitlines() if ln.startswith("LOG INFO")]
    if drift:
        assert bad == "BAD ['states.SamplingStates.any_greedy']"
        assert attached == "ATTACHED False False False"
        assert sum("vLLM's sampler answers its own per-step questions" in ln for ln in logs) == 1, logs
    else:
        assert bad == "BAD []"
        assert attached == "ATTACHED True True True"
    assert any(ln.startswith("LOG INFO mtpstate: active;") for ln in logs), logs


_BAD_PARAMS = (
    _KEEP_RECORDS
    + """
    sys.path.insert(0, {here!r})
    import copy, pickle
    from types import SimpleNamespace
    from mtpstate.tools.vllm_bench.reference import MRV2Reference, load_plugin
    from mtpstate.tools.vllm_bench.shims import install_cpu_shims
    from mtpstate.tools.vllm_bench.driver import Driver
    from mtpstate.tools.vllm_bench.workloads import WORKLOADS, write_model_dir
    from mtpstate.errors import InvalidStepError
    install_cpu_shims()
    load_plugin()
    w = WORKLOADS["sync-spec3-chunked"]
    drv = Driver(w, write_model_dir())
    r = MRV2Reference(w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, drv.block_sizes, w.num_spec,
                      use_mtpstate=True, sampler=True)
    cases = [("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "0.7"),
             ("seed", 2**63), ("logprobs", -2), ("top_k", None), ("missing", None), ("reentrant", None)]
    tested = 0
    for so in drv.steps():
        quiet = not so.finished_req_ids and not so.preempted_req_ids
        if so.scheduled_new_reqs and quiet and tested < len(cases):
            field, value = cases[tested]
            bad = pickle.loads(pickle.dumps(so))
            req = bad.scheduled_new_reqs[-1]
            if field == "missing":
                sp = req.sampling_params
                req.sampling_params = SimpleNamespace(**{{k: getattr(sp, k) for k in ("temperature", "top_k")}})
            elif field == "reentrant":
                class Reenter:  # a property that re-enters the runner's step
                    def __init__(self, sp, step):
                        self.sp, self.step = sp, step
                    def __getattr__(self, name):
                        if name == "top_p":
                            r.apply(self.step)
                        return getattr(self.sp, name)
                req.sampling_params = Reenter(req.sampling_params, pickle.loads(pickle.dumps(so)))
            else:
                setattr(req.sampling_params, field, value)
            before = (r.state(), r.sampler_state(), dict(r.req_states.req_id_to_index))
            try:
                r.apply(bad)
                print("CASE", field, "not refused")
            except InvalidStepError as e:
                same = before == (r.state(), r.sampler_state(), dict(r.req_states.req_id_to_index))
                print("CASE", field, req.req_id in str(e), ("sampling_params" in str(e)), same, str(e)[:160])
            tested += 1
        r.apply(so)  # the good step, applied as sent
        r.prepare(so, r.gather(so))
    print("TESTED", tested)
"""
)


def test_bad_sampling_params_are_refused_whole():
    """A new request whose sampling params cannot be written as vLLM would
    (NaN or inf temperature, a str, a seed outside int64, logprobs < -1, an
    int field None, a missing attribute, a property that re-enters the
    runner's step) makes the step raise
    InvalidStepError naming the request and the field, with nothing
    changed (request state, sampler arrays, vLLM's id map); the same step
    unchanged then applies."""
    p = _run(_BAD_PARAMS.format(here=HERE), env_on=False)
    cases = [ln for ln in p.stdout.splitlines() if ln.startswith("CASE")]
    assert _lines(p, "TESTED") == "TESTED 8", p.stdout[-3000:]
    for ln in cases:
        assert " True True True " in ln, ln
    assert "re-entrant" in cases[-1], cases[-1]
