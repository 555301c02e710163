"""The command line as a user meets it: every user error is one line on
stderr naming the flag or file, exit status 2 (usage) or 1 (runtime), no
traceback unless --debug; checks happen before any work; every file written
is reported; no progress frames in pipes; help with defaults and examples."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mtpstate.tools.cli import main


def run_main(argv, capsys):
    """(exit status, stdout, stderr) of ``mtpstate argv`` run in-process."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err, *words):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "error:" in lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


USAGE_ERRORS = [
    (["bench", "--sizes", "0"], "--sizes"),
    (["bench", "--sizes", "-5"], "--sizes"),
    (["bench", "--sizes", "abc"], "--sizes"),
    (["bench", "--sizes", "1,,4"], "--sizes"),
    (["bench", "--only", "nope"], "--only"),
    (["sim", "--steps", "0", "--out", "{tmp}/t"], "--steps"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--accept", "1.5"], "--accept"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--accept", "nan"], "--accept"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--num-spec", "-1"], "--num-spec"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--max-num-reqs", "0"], "--max-num-reqs"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--block-sizes", "0"], "--block-sizes"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--block-sizes", "16,0"], "--block-sizes"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--arrivals", "-1"], "--arrivals"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--prompt-len", "500,10"], "--prompt-len"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--prompt-len", "5"], "--prompt-len"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--prompt-len", "16,5000"], "--max-model-len"),
    (["sim", "--steps", "5", "--out", "{tmp}/t", "--preempt", "2"], "--preempt"),
    (["sim", "--steps", "5", "--out", "{tmp}/nodir/t"], "--out"),
    (["sim", "--steps", "5", "--out", "{tmp}"], "--out"),
    (["sim", "--steps", "5"], "--out"),
    (["bench", "--json", "{tmp}/nodir/b.json"], "--json"),
    (["bench", "--plot", "{tmp}"], "--plot"),
    ([], "command"),
    (["frobnicate"], "frobnicate"),
]


@pytest.mark.parametrize("argv,flag", USAGE_ERRORS, ids=[" ".join(a) or "bare" for a, _ in USAGE_ERRORS])
def test_usage_errors(tmp_path, capsys, argv, flag):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc, out, err = run_main(argv, capsys)
    assert rc == 2
    one_line_error(err, flag)
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_trace_file_errors(tmp_path, capsys):
    garbage = tmp_path / "garbage.trace"
    garbage.write_bytes(b"MTPTRACE" + bytes(range(256)) * 4)
    truncated = tmp_path / "short.trace"
    main(["sim", "--steps", "20", "--max-num-reqs", "4", "--out", str(truncated)])
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    flipped = tmp_path / "flipped.trace"
    flipped.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    capsys.readouterr()
    for path in (tmp_path / "missing.trace", tmp_path, garbage, truncated, flipped):
        rc, out, err = run_main(["replay", str(path)], capsys)
        assert rc == 1, path
        one_line_error(err, str(path))


def test_missing_matplotlib_is_checked_before_the_run(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    rc, out, err = run_main(["bench", "--sizes", "1", "--json", str(tmp_path / "b.json"), "--plot", "x.png"], capsys)
    assert rc == 1
    one_line_error(err, "--plot", "matplotlib")
    assert not (tmp_path / "b.json").exists()  # the run never started


def test_sim_replay_bench_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (pip install 'mtpstate[plot]')")
    trace = tmp_path / "cli.trace"
    argv = ["sim", "--steps", "60", "--seed", "5", "--num-spec", "2", "--accept", "0.6", "--max-num-reqs", "8"]
    rc, out, err = run_main(argv + ["--out", str(trace)], capsys)
    assert rc == 0 and f"wrote {trace}" in out
    out_json, plot = tmp_path / "r.json", tmp_path / "r.png"
    rc, out, err = run_main(["replay", str(trace), "--json", str(out_json), "--plot", str(plot)], capsys)
    assert rc == 0 and f"wrote {out_json}" in out and f"wrote {plot}" in out
    res = json.loads(out_json.read_text())
    assert res["steps"] == 60 and set(res["impls"]) == {"vectorized", "loop", "legacy"}
    for impl in res["impls"].values():
        assert isinstance(impl["max_drift"], int) and impl["us_per_step"] > 0
    assert plot.stat().st_size > 1000
    bench_json, bench_png = tmp_path / "b.json", tmp_path / "b.png"
    rc, out, err = run_main(
        ["bench", "--quick", "--sizes", "16,1", "--json", str(bench_json), "--plot", str(bench_png)], capsys
    )
    assert rc == 0 and f"wrote {bench_json}" in out and f"wrote {bench_png}" in out
    assert "\r" not in err  # pytest's capture is not a terminal: no progress frames
    b = json.loads(bench_json.read_text())
    assert {"date", "mtpstate", "python", "numpy", "numba", "torch", "cpu", "mirror_device"} <= set(b["machine"])
    assert {r["impl"] for r in b["results"]} >= {"loop", "vectorized", "dict", "index", "mrv2-loop"}
    assert np.isfinite([r["median_us"] for r in b["results"]]).all()
    # the console: a header with the run's metadata, one table per workload, sizes in numeric order
    assert b["machine"]["date"] in out and b["machine"]["mtpstate"] in out
    for wl in ("steady-decode", "mixed", "vllm-busy", "index-lookup-fresh-ids"):
        assert f"\n{wl}\n" in out
    rows = [line for line in out.splitlines() if line.lstrip().split(" ")[0] in ("1", "16")]
    assert [r.split()[0] for r in rows[:2]] == ["1", "16"]
    assert bench_png.stat().st_size > 10000


@pytest.mark.parametrize("cmd", ["sim", "replay", "bench", "warmup"])
def test_help_shows_defaults_and_an_example(capsys, cmd):
    rc, out, err = run_main([cmd, "--help"], capsys)
    assert rc == 0
    assert "example" in out and f"mtpstate {cmd}" in out.split("example", 1)[1]
    if cmd in ("sim", "bench", "replay"):
        assert "(default:" in out


def test_version(capsys):
    from mtpstate import __version__

    rc, out, err = run_main(["--version"], capsys)
    assert rc == 0 and out.startswith(f"mtpstate {__version__}")


def test_warmup_command(capsys):
    rc, out, err = run_main(["warmup"], capsys)
    assert rc == 0 and "kernels ready" in out


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "mtpstate", *args], capture_output=True, text=True, timeout=120, **kw)


def test_real_process_no_traceback_and_debug(tmp_path):
    """As a shell runs it: one line and status 1 for a missing file; the
    traceback with --debug (before or after the command)."""
    p = _cli("replay", str(tmp_path / "nope.trace"))
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    for argv in (["--debug", "replay"], ["replay", "--debug"]):
        p = _cli(*argv, str(tmp_path / "nope.trace"))
        assert p.returncode == 1 and "Traceback" in p.stderr


def test_progress_in_a_pipe_is_plain_lines(tmp_path):
    p = _cli("sim", "--steps", "30", "--max-num-reqs", "4", "--out", str(tmp_path / "t.trace"))
    assert p.returncode == 0 and "\r" not in p.stderr and f"wrote {tmp_path / 't.trace'}" in p.stdout


def test_compile_notice(capsys, monkeypatch):
    """Kernels compiled (not loaded from cache) are announced once per
    process, in one line with their duration and how to avoid the wait;
    anything outside mtpstate is not."""
    import numba

    from mtpstate._kernels.jit import COMPILE_NOTICE

    monkeypatch.setattr(COMPILE_NOTICE, "entries", frozenset({"_probe_kernel"}))
    monkeypatch.setattr(COMPILE_NOTICE, "printed", False)

    def elsewhere(x):
        return x + 2

    numba.njit(elsewhere)(1)
    assert capsys.readouterr().err == ""
    for k in range(2):

        def _probe_kernel(x, k=k):
            return x + k

        _probe_kernel.__module__ = "mtpstate._probe"
        numba.njit(_probe_kernel)(1)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "mtpstate: compiled its kernels in" in err and "_probe_kernel" in err and "mtpstate warmup" in err


def test_no_notice_when_loaded_from_cache():
    import mtpstate

    mtpstate.warmup()  # compiled (or loaded) in this process: the cache is filled
    p = subprocess.run(
        [sys.executable, "-c", "import mtpstate; mtpstate.warmup()"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and p.stderr == ""


def test_vllm_check_without_vllm(capsys, monkeypatch):
    """No vLLM here: one line per fact, exit status 1, nothing raised; --json
    for scripts. (`make test-vllm` runs it against vLLM 0.34.0.)"""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    rc, out, err = run_main(["vllm-check"], capsys)
    assert rc == 1 and not err
    assert "vLLM: not installed" in out and "would do nothing: vLLM is not installed" in out
    rc, out, err = run_main(["vllm-check", "--json"], capsys)
    facts = json.loads(out)
    assert rc == 1 and facts["would_apply"] is False and facts["vllm"] is None


def _bench_vllm_in(tmp_path, *args, pythonpath=None, command="bench-vllm"):
    """``mtpstate bench-vllm`` (or ``command``) in a fresh process started in
    ``tmp_path``, with ``pythonpath`` (a directory) first on the path: as a
    user runs it."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return _cli(command, *args, cwd=tmp_path, env=env)


def _fake_vllm(tmp_path, command: str):
    """A package under ``tmp_path / "site"`` that says it is vLLM 0.1.0 and
    fails if ``command`` runs anything of it beyond its version module."""
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "version.py").write_text("__version__ = '0.1.0'\n")
    (fake / "platforms.py").write_text(f"raise RuntimeError('{command} ran vLLM before checking its version')\n")
    return fake


def _unusable(p, tmp_path, *words):
    """One line on stderr, exit status 2, nothing written, nothing run."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    one_line_error(p.stderr, *words)
    assert p.stdout == "" and not (tmp_path / "out.json").exists()


def test_bench_vllm_without_vllm(tmp_path):
    """No vLLM in this environment (`make test` installs none): the line says
    so and where it looked; with --device cuda too (vLLM is checked first)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: vllm_proof/test_bench_vllm.py covers bench-vllm with it")
    for argv in ([], ["--device", "cuda"]):
        p = _bench_vllm_in(tmp_path, "--quick", "--json", "out.json", *argv)
        _unusable(p, tmp_path, "vLLM is not installed", sys.executable)


def test_bench_vllm_unsupported_version(tmp_path):
    """A vLLM that is not a supported release (a package that says it is
    0.1.0), or one whose version cannot be read: refused, by name, before
    anything of it beyond its version module runs."""
    fake = _fake_vllm(tmp_path, "bench-vllm")
    p = _bench_vllm_in(tmp_path, "--quick", "--json", "out.json", pythonpath=tmp_path / "site")
    _unusable(p, tmp_path, "vLLM 0.1.0 is not a supported version", "0.34.0")
    (fake / "version.py").write_text("raise ImportError('a broken install')\n")
    p = _bench_vllm_in(tmp_path, "--quick", "--json", "out.json", pythonpath=tmp_path / "site")
    _unusable(p, tmp_path, "`import vllm.version` fails")


def test_vllm_verify_without_a_usable_vllm(tmp_path):
    """`mtpstate vllm-verify` where there is no vLLM, or one mtpstate does
    not support: one line, exit status 2, nothing written, nothing run."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        p = _bench_vllm_in(tmp_path, "--quick", "--json", "out.json", command="vllm-verify")
        _unusable(p, tmp_path, "vLLM is not installed", sys.executable)
    _fake_vllm(tmp_path, "vllm-verify")
    p = _bench_vllm_in(tmp_path, "--json", "out.json", pythonpath=tmp_path / "site", command="vllm-verify")
    _unusable(p, tmp_path, "vLLM 0.1.0 is not a supported version", "0.34.0")


@pytest.mark.parametrize(
    "command,flags",
    [
        ("bench-vllm", (("--sizes", "0"), ("--workload", "nope"), ("--device", "tpu"), ("--repeats", "0"))),
        ("vllm-verify", (("--workload", "nope"), ("--device", "tpu"), ("--steps", "0"), ("--sabotage", "nope"))),
    ],
)
def test_vllm_commands_usage_errors(tmp_path, command, flags):
    bad_json = ("--json", str(tmp_path / "no" / "such" / "dir" / "out.json"))
    for argv in (*flags, bad_json):
        p = _cli(command, *argv)
        assert p.returncode == 2, (argv, p.stderr)
        assert argv[0] in p.stderr and "Traceback" not in p.stderr
