"""The README's Python snippet runs as written, and every `mtpstate ...`
command in README.md and docs/ is accepted by the command line's parser."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mtpstate.tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_snippet_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    use = readme.split("## Use", 1)[1]
    snippet = python_blocks(use)[0]
    p = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr


def commands():
    out = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                line = line.split("  #", 1)[0].strip()
                if line.startswith("mtpstate "):
                    out.append((doc.name, line))
        for inline in re.findall(r"`(mtpstate [^`]+)`", doc.read_text()):
            if " --" in inline and "[" not in inline:  # a full command, not a mention
                out.append((doc.name, inline))
    return out


@pytest.mark.parametrize("doc,line", commands(), ids=[f"{d}: {c}" for d, c in commands()])
def test_documented_commands_parse(doc, line):
    argv = shlex.split(line)[1:]
    argv = [a for a in argv if not (a.startswith("[") or a.endswith("]"))]  # optional parts of a synopsis
    if "--help" in argv or "--version" in argv:
        return
    build_parser().parse_args(argv)  # exits with status 2 on a flag or value the parser rejects


def test_vllm_adapter_imports_no_vllm():
    code = "import sys, mtpstate.integrations.vllm as m; assert 'vllm' not in sys.modules; print(m.__all__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "ModelRunnerV2State" in p.stdout, p.stderr


def _report():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "report.py")
    spec = importlib.util.spec_from_file_location("report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_figures_are_generated_from_the_committed_json():
    """Every table of figures in README.md and docs/ is what
    `benchmarks/report.py` makes of the committed JSON, verbatim; each
    region is present where the docs rely on it."""
    import os

    report = _report()
    assert report.check() == []
    found = {}
    for rel in report.FILES:
        with open(os.path.join(report.ROOT, rel)) as f:
            found[rel] = {m.group(2) for m in report._REGION.finditer(f.read())}
    assert found["README.md"] >= {"headline"}
    assert found["docs/benchmarks.md"] >= {"headline", "kernel", "bookkeeping", "runner-summary"}
    assert found["docs/vllm.md"] >= {"runner", "bookkeeping"}


def test_the_figures_check_can_fail(monkeypatch):
    report = _report()
    monkeypatch.setitem(report.REGIONS, "runner", lambda: "| a table typed by hand |")
    assert report.check() == ["docs/vllm.md: runner"]


def test_a_figure_in_a_sentence_is_checked(monkeypatch, tmp_path):
    """A figure inside a sentence (``<!-- fig:... -->``) that no longer says
    what its JSON says is reported, as is one that names nothing."""
    report = _report()
    right = report.figure("runner/steady-1/speedup")
    (tmp_path / "doc.md").write_text(
        f"<!-- fig:runner/steady-1/speedup -->{right}<!-- /fig --> faster, "
        "<!-- fig:runner/steady-16/speedup -->9.99x<!-- /fig --> at 16 "
        "and <!-- fig:runner/no-such/speedup -->1x<!-- /fig -->.\n"
    )
    monkeypatch.setattr(report, "ROOT", str(tmp_path))
    monkeypatch.setattr(report, "FILES", ("doc.md",))
    bad = report.check()
    assert bad[0] == "doc.md: fig runner/steady-16/speedup"
    assert bad[1].startswith("doc.md: fig runner/no-such/speedup names nothing")
    assert len(bad) == 2


def test_a_figure_typed_by_hand_is_found():
    """A measured-looking number in the prose fails the check unless it is
    generated (a region or a figure) or states a workload's input."""
    report = _report()
    assert report.hand_typed("README.md", "The runner is 3.5x faster at N = 1.")
    assert report.hand_typed("docs/vllm.md", "Its update takes ~5-8 ns per request.")
    assert len(report.hand_typed("docs/vllm.md", "It compiles in 14.0 s, 20% less.")) == 2
    assert not report.hand_typed("README.md", "It is <!-- fig:runner/steady-1/speedup -->1.94x<!-- /fig --> faster.")
    assert not report.hand_typed("README.md", "Run `mtpstate bench --repeats 5` (`5 s`).")
    assert not report.hand_typed("docs/benchmarks.md", "Requests carry a mix of sampling params: 22% greedy.")
    assert report.hand_typed("docs/vllm.md", "Requests carry a mix of sampling params: 22% greedy.")  # (per file)
