"""The tier runs in the dependency set a vLLM install brings: numba exactly
as the vLLM release under test pins it (its sdist's requirements), so what
passes here passes in a user's vLLM environment."""

import os
import re

import numba


def _vllm_pin(package: str) -> str:
    src = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # the vLLM source under test
    with open(os.path.join(src, "requirements", "cuda.txt")) as f:
        m = re.search(rf"^{package}\s*==\s*([\w.]+)", f.read(), re.M)
    assert m, f"vLLM's requirements/cuda.txt pins no {package}"
    return m.group(1)


def test_numba_is_the_version_vllm_pins():
    assert numba.__version__ == _vllm_pin("numba")
