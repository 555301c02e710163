"""A maintainer's first step towards supporting a new vLLM release: what its
source changed of what mtpstate changes, computes or relies on, read from an
unpacked sdist before anything is written (nothing is imported, nothing
built).

For the supported release nearest the tree's version (or ``--release``):
each definition of ``plugin.definitions`` (the runner methods the patch
changes, the functions mtpstate computes in their place, the sampler
methods it answers and writes for) with its verdict, then whether the
worked patch (``mrv2.patch``) applies to the tree (``patch --dry-run``).
Exit status 0 only when nothing drifted and the patch applies.

    python vllm_proof/drift.py .vllm/vllm-0.33.0 [--release 0.34.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from mtpstate.integrations.vllm import plugin
from mtpstate.integrations.vllm.releases import RELEASES


def tree_version(src: str) -> str | None:
    """The release of an unpacked vLLM sdist (``vllm/_version.py``)."""
    try:
        with open(os.path.join(src, "vllm", "_version.py")) as f:
            m = re.search(r"__version__ = version = '([^']+)'", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def read_module(src: str):
    """``module name -> its source text`` in the tree ``src``."""

    def read(module: str) -> str:
        with open(os.path.join(src, *module.split(".")) + ".py", encoding="utf-8") as f:
            return f.read()

    return read


def patch_applies(src: str, release: str) -> tuple[bool, str]:
    """Whether ``release``'s patch applies to the tree ``src`` (a dry run)."""
    patch = RELEASES[release].patch_path
    p = subprocess.run(["patch", "-p1", "--dry-run", "-d", src, "-i", patch], capture_output=True, text=True)
    return p.returncode == 0, (p.stdout + p.stderr).strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="an unpacked vLLM sdist (the directory holding vllm/)")
    p.add_argument("--release", choices=list(plugin.SUPPORTED), help="compare with this supported release")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.src, "vllm", "v1", "worker", "gpu", "model_runner.py")):
        print(f"{args.src}: not an unpacked vLLM source tree with Model Runner V2", file=sys.stderr)
        return 2
    version = tree_version(args.src)
    release = args.release or plugin.nearest_release(version)
    verdicts = plugin.drift(read_module(args.src), release)
    applies, patch_text = patch_applies(args.src, release)
    drifted = {k: v for k, v in verdicts.items() if v != "ok"}
    print(f"vLLM {version} at {args.src}, against mtpstate's support of vLLM {release}:")
    for name, verdict in verdicts.items():
        print(f"  {name}: {verdict}")
    print(f"  mrv2.patch: {'applies' if applies else 'does not apply: ' + patch_text.splitlines()[-1]}")
    print(f"{len(drifted)} of {len(verdicts)} definitions drifted; the patch {'applies' if applies else 'fails'}")
    if args.json:
        doc = {"vllm": version, "release": release, "definitions": verdicts, "patch_applies": applies}
        doc["patch_output"] = patch_text
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if not drifted and applies else 1


if __name__ == "__main__":
    sys.exit(main())
