"""A vLLM release's own unit tests for the worker and Model Runner V2, run on CPU
up to four ways (``--modes``: which of 2-4); exactly the tests that pass
without mtpstate must pass with it.

1. vLLM's unpatched source (the baseline);
2. the same source with vLLM's general plugins loaded first and
   ``VLLM_USE_MTPSTATE=1`` (mtpstate's plugin patches the runner);
3. the source tree with ``mrv2.patch`` applied, ``VLLM_USE_MTPSTATE=1``;
4. the unpatched source, plugins loaded, ``VLLM_USE_MTPSTATE=shadow``
   (vLLM's own methods, observed by mtpstate's shadow).

Some of these tests fail on CPU with or without mtpstate (no CUDA, no
Triton, optional packages, no model hub): pass sets are compared, not totals.

Usage: python vllm_proof/vllm_own_tests.py SRC PATCHED_SRC [--modes plugin,patch,shadow] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_DIRS = ("tests/v1/worker", "tests/v1/streaming_input")
_RESULT = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)")


def run(src: str, plugin: bool, patched: bool, shadow: bool = False) -> dict:
    """vLLM's tests of ``src`` against the vLLM of ``src`` (pytest runs in
    it: ``python -m pytest`` puts the working directory first on sys.path)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, HERE]), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name in ("VLLM_USE_MTPSTATE", "MTPSTATE_LOAD_VLLM_PLUGINS", "VLLM_PLUGINS"):
        env.pop(name, None)
    if plugin or patched:
        env["VLLM_USE_MTPSTATE"] = "shadow" if shadow else "1"
    if plugin:
        env["MTPSTATE_LOAD_VLLM_PLUGINS"] = "1"
    cmd = [sys.executable, "-m", "pytest", "--noconftest", "--import-mode=importlib", "-p", "no:cacheprovider"]
    cmd += ["--continue-on-collection-errors", "-rA", "-q", "-o", "faulthandler_timeout=120"]
    cmd += ["-p", "vllm_plugins_loaded", *TEST_DIRS]
    p = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=1800)
    outcome: dict[str, str] = {}
    for line in p.stdout.splitlines():
        m = _RESULT.match(line)
        if m:
            outcome.setdefault(m.group(2), m.group(1))
    report = None
    for line in p.stdout.splitlines():
        if line.startswith("MTPSTATE-REPORT "):
            report = json.loads(line.split(" ", 1)[1])
    return {"outcome": outcome, "plugin": report, "tail": p.stdout[-2000:] + p.stderr[-2000:]}


def counts(outcome: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in outcome.values():
        out[v] = out.get(v, 0) + 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a supported vLLM release's unpacked sdist (source and tests)")
    ap.add_argument("patched", help="the same tree with that release's mrv2.patch applied")
    ap.add_argument(
        "--modes",
        default="plugin,patch,shadow",
        help="the runs with mtpstate besides vLLM's own, comma-separated (default: all three)",
    )
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    src, patched = os.path.abspath(args.src), os.path.abspath(args.patched)
    how = {
        "plugin": lambda: run(src, plugin=True, patched=False),
        "patch": lambda: run(patched, plugin=False, patched=True),
        "shadow": lambda: run(src, plugin=True, patched=False, shadow=True),
    }
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(how):
        ap.error(f"--modes: a comma-separated subset of {', '.join(how)}")
    runs = {"vllm": run(src, plugin=False, patched=False)}
    runs.update((m, how[m]()) for m in modes)
    base = {t for t, o in runs["vllm"]["outcome"].items() if o == "PASSED"}
    ok = bool(base)
    summary = {}
    for name, r in runs.items():
        passed = {t for t, o in r["outcome"].items() if o == "PASSED"}
        lost, gained = sorted(base - passed), sorted(passed - base)
        summary[name] = {"counts": counts(r["outcome"]), "lost": lost, "gained": gained, "plugin": r["plugin"]}
        c = summary[name]["counts"]
        print(
            f"vLLM's own tests, {name:>6}: {c.get('PASSED', 0)} passed, {c.get('FAILED', 0)} failed, "
            f"{c.get('ERROR', 0)} errors, {c.get('SKIPPED', 0)} skipped; "
            f"passing without mtpstate but not here: {len(lost)}; the other way: {len(gained)}"
        )
        for t in lost[:20]:
            print(f"  lost: {t}")
        ok &= not lost and not gained
        if not r["outcome"]:
            print(r["tail"])
            ok = False
    # each run must have tested what it says, else its pass set proves nothing
    expect = {
        "vllm": {"vllm": src, "patch_in_source": False, "applied_by_plugin": False, "shadow_set_up": False},
        "plugin": {"vllm": src, "patch_in_source": False, "applied_by_plugin": True, "shadow_set_up": False},
        "patch": {"vllm": patched, "patch_in_source": True, "applied_by_plugin": False, "shadow_set_up": False},
        "shadow": {"vllm": src, "patch_in_source": False, "applied_by_plugin": False, "shadow_set_up": True},
    }
    for name, want in expect.items():
        if name not in runs:
            continue
        rep = runs[name]["plugin"] or {}
        print(f"{name} run: {json.dumps(rep)}")
        want = dict(want, vllm=os.path.join(want["vllm"], "vllm"), runner_module_imported=True)
        wrong = {k: rep.get(k) for k, w in want.items() if rep.get(k) != w}
        if wrong:
            print(f"  the {name} run is not what it should be: {wrong}")
            ok = False
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
