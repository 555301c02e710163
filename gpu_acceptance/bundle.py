"""``make gpu-bundle``: everything a GPU machine without network needs,
beyond its image, for the acceptance run (``gpu_acceptance/run.sh``), in one
folder of at most 60 MiB:

- ``vllm-<release>.tar.xz``: the Python package of each bundled vLLM
  release (its sdist's ``vllm/``, unpacked by ``vllm_proof/fetch_vllm.py``
  from the package index, sha256-pinned; nothing built);
- ``wheels/``: ``bundle-requirements.txt``, for CPython 3.12 (``--python``),
  manylinux x86_64 (or pure Python / abi3), fetched with ``--no-deps``;
- ``manifest.json``: what is in it, each file's size and sha256.

mtpstate itself is the working tree, which travels with the run anyway.

Usage: ``python gpu_acceptance/bundle.py [OUT] [--vllm-dir DIR] [--python
X.Y]`` (default ``gpu-bundle``, ``.vllm``, ``3.12``: the GPU image's
Python). Standard library and pip only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
MAX_BYTES = 60 * 2**20

# the supported releases that import and pass `vllm-verify --quick` on the
# image's torch (2.11.0), newest first: all three (checked by hand on
# torch 2.11.0; CI checks them on the same torch with the bundle installed)
RELEASES = ("0.34.0", "0.33.0", "0.32.0")

# pip's spelling of "CPython 3.12 on manylinux x86_64" (the image's glibc
# takes every manylinux tag up to 2_31)
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in (31, 28, 27, 26, 24, 17, 5)] + ["manylinux2014_x86_64"]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pack(src: str, dest: str) -> None:
    """The ``vllm/`` package of the unpacked sdist ``src`` (no bytecode)."""
    tmp = dest + ".part"
    with tarfile.open(tmp, "w:xz", preset=1) as tar:  # (fast: 3 releases in seconds, well within 60 MiB)
        tar.add(
            os.path.join(src, "vllm"),
            arcname="vllm",
            filter=lambda t: None if "__pycache__" in t.name or t.name.endswith((".pyc", ".so")) else t,
        )
    os.replace(tmp, dest)


def _wheels(dest: str, python: str) -> None:
    abi = "cp" + python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += ["-d", dest, "-r", os.path.join(HERE, "bundle-requirements.txt")]
    subprocess.run(cmd, check=True)


def build(out: str, vllm_dir: str, python: str = "3.12") -> dict:
    missing = [r for r in RELEASES if not os.path.isdir(os.path.join(vllm_dir, f"vllm-{r}", "vllm"))]
    if missing:
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "vllm_proof", "fetch_vllm.py"), vllm_dir, *missing], check=True
        )
    os.makedirs(out, exist_ok=True)
    wheels = os.path.join(out, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    _wheels(wheels, python)
    for r in RELEASES:
        dest = os.path.join(out, f"vllm-{r}.tar.xz")
        if not os.path.exists(dest):
            _pack(os.path.join(vllm_dir, f"vllm-{r}"), dest)
    files = {}
    for base, _, names in os.walk(out):
        for name in sorted(names):
            path = os.path.join(base, name)
            rel = os.path.relpath(path, out)
            if rel != "manifest.json":
                files[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    total = sum(f["bytes"] for f in files.values())
    manifest = {"releases": list(RELEASES), "python": python, "bytes": total, "files": files}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv: list[str]) -> int:
    out, vllm_dir, python = "gpu-bundle", os.path.join(ROOT, ".vllm"), "3.12"
    args = list(argv)
    for flag in ("--vllm-dir", "--python"):
        if flag in args:
            i = args.index(flag)
            if flag == "--python":
                python = args[i + 1]
            else:
                vllm_dir = args[i + 1]
            del args[i : i + 2]
    if args:
        out = args[0]
    m = build(os.path.abspath(out), os.path.abspath(vllm_dir), python)
    mib = m["bytes"] / 2**20
    n_wheels = sum(1 for k in m["files"] if k.startswith("wheels"))
    print(f"gpu-bundle: {out}: vLLM {', '.join(m['releases'])} and {n_wheels} wheels, {mib:.1f} MiB")
    if m["bytes"] > MAX_BYTES:
        print(f"gpu-bundle: {mib:.1f} MiB is over the {MAX_BYTES / 2**20:.0f} MiB a run may carry", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
