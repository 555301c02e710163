"""The kernels' on-disk cache is keyed to mtpstate's version and to every
kernel source file: a changed helper in one file recompiles the entry
kernels of another (numba alone keys an entry kernel to its own file)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mtpstate
from mtpstate._kernels import jit as jit_module

KERNELS = Path(jit_module.__file__).parent
PACKAGE = Path(mtpstate.__file__).parent

pytestmark = pytest.mark.skipif(jit_module.JIT_DISABLED, reason="the cache exists only for compiled kernels")


@pytest.mark.parametrize("name", sorted(p.name for p in KERNELS.glob("*.py")))
def test_every_kernel_file_is_in_the_key(tmp_path, name):
    folder = tmp_path / "_kernels"
    shutil.copytree(KERNELS, folder, ignore=shutil.ignore_patterns("__pycache__"))
    before = jit_module.kernel_source_key("1.0", folder)
    assert before == jit_module.kernel_source_key("1.0", folder)
    with open(folder / name, "a") as f:
        f.write("# changed\n")
    assert jit_module.kernel_source_key("1.0", folder) != before


def test_the_version_is_in_the_key():
    assert jit_module.kernel_source_key("1.0") != jit_module.kernel_source_key("1.1")
    assert jit_module.KERNEL_SOURCE_KEY == jit_module.kernel_source_key()


# insert "ab", then look up "ax": unknown (the key is every byte of the id)
_PROBE = """
from mtpstate import RequestIndex, UnknownRequestError
ix = RequestIndex(2)
ix.insert(["ab"])
try:
    print("found", ix.lookup(["ax"])[0])
except UnknownRequestError:
    print("unknown")
"""
# a helper of the index's entry kernels, in pyobjects.py: ids keyed by their
# first byte only
_HELPER = "return obj + tp[8], load_i64(obj + OFF_SIZE), OK"
_MUTANT = "return obj + tp[8], 1, OK"


def test_a_changed_helper_file_recompiles_the_entry_kernels(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(PACKAGE, root / "mtpstate", ignore=shutil.ignore_patterns("__pycache__"))
    helper = root / "mtpstate" / "_kernels" / "pyobjects.py"
    entry = root / "mtpstate" / "_kernels" / "index.py"
    text = helper.read_text()
    assert text.count(_HELPER) == 1
    env = dict(os.environ, PYTHONPATH=str(root), NUMBA_CACHE_DIR=str(tmp_path / "cache"), MTPSTATE_COMPILE_NOTICE="1")

    def run():  # (in tmp_path: "-c" puts the working directory first on sys.path)
        p = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert p.returncode == 0, p.stderr
        return p.stdout.strip(), "compiled its kernels" in p.stderr

    assert run() == ("unknown", True)  # compiled, cached
    assert run() == ("unknown", False)  # loaded from the cache
    stamp = entry.stat()
    helper.write_text(text.replace(_HELPER, _MUTANT))
    os.utime(entry, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the entry kernel's file as it was
    assert run() == ("found 0", True)  # the helper's change runs
    helper.write_text(text)
    assert run() == ("unknown", True)
