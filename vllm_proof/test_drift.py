"""The next release is a known step: `vllm_proof/drift.py` reads an unpacked
vLLM tree and names every definition mtpstate changes, computes or relies
on that differs from the supported release nearest it, and whether the
patch applies; `mtpstate vllm-check` names the same drift on an
unsupported vLLM."""

import os
import shutil
import subprocess
import sys

from mtpstate.integrations.vllm import plugin

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # the tier's vLLM source
RELEASE = plugin.installed_release()  # (its release)


def _drift(src, *args):
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "drift.py"), src, *args], capture_output=True, text=True, timeout=120
    )


def test_the_supported_tree_has_no_drift():
    p = _drift(SRC)
    assert p.returncode == 0, p.stdout + p.stderr
    n = sum(len(v) for v in plugin.definitions(RELEASE).values())
    assert f"0 of {n} definitions drifted; the patch applies" in p.stdout


def _tree_with_a_changed_method(tmp_path):
    """The files the check reads, copied, with one sampler method changed
    and one runner method's body changed."""
    dst = tmp_path / "vllm-next"
    for mod in [*plugin.definitions(RELEASE), "vllm._version"]:
        rel = os.path.join(*mod.split(".")) + ".py"
        os.makedirs(dst / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(SRC, rel), dst / rel)
    states = dst / "vllm" / "v1" / "worker" / "gpu" / "sample" / "states.py"
    text = states.read_text()
    assert "    def add_request(" in text
    states.write_text(text.replace("    def add_request(", "    def add_request(  # changed upstream\n", 1))
    version = dst / "vllm" / "_version.py"
    version.write_text(version.read_text().replace(f"'{RELEASE}'", "'9.9.0'"))
    return dst


def test_a_changed_definition_is_named(tmp_path):
    p = _drift(str(_tree_with_a_changed_method(tmp_path)), "--release", RELEASE)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "vLLM 9.9.0 at" in p.stdout and f"against mtpstate's support of vLLM {RELEASE}" in p.stdout
    lines = [line for line in p.stdout.splitlines() if f"differs from vLLM {RELEASE}'s" in line]
    assert lines == [line for line in lines if "vllm.v1.worker.gpu.sample.states:SamplingStates.add_request" in line]
    assert len(lines) == 1
    assert "the patch applies" in p.stdout  # (model_runner.py is unchanged)


def test_vllm_check_names_the_nearest_release_and_its_drift(monkeypatch):
    later = RELEASE.rsplit(".", 1)[0] + ".99"  # (a later patch release: this one is the nearest)
    monkeypatch.setattr(plugin, "_version", lambda: later)
    facts = plugin.report()
    assert not facts["supported"] and not facts["would_apply"]
    assert facts["nearest_supported"] == RELEASE
    assert facts["drift"] == {}  # (the source here is that release's: only the version differs)
    assert any(f"{later} is not a supported version" in r for r in facts["reasons"])
