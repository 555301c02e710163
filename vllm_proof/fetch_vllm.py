"""Fetch the sdists of the vLLM releases mtpstate supports from the package
index and unpack them (nothing is built: ``pip download`` would run its
metadata build, which needs a Rust toolchain). Each archive's sha256 is
pinned.

Usage: python vllm_proof/fetch_vllm.py DEST_DIR [version ...]  (default: all)
"""

import hashlib
import os
import re
import sys
import tarfile
import time
import urllib.parse
import urllib.request

SHA256 = {
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
}
INDEX = os.environ.get("MTPSTATE_VLLM_INDEX", "https://pypi.org/simple/vllm/")


def _get(url: str) -> bytes:
    for attempt in range(4):
        try:
            with urllib.request.urlopen(url, timeout=120) as r:
                return r.read()
        except OSError:
            if attempt == 3:
                raise
            time.sleep(2 * (attempt + 1))
    raise AssertionError


def main(dest: str, versions: list[str]) -> int:
    for version in versions or list(SHA256):
        if version not in SHA256:
            print(f"no pinned sha256 for vLLM {version} (known: {', '.join(SHA256)})", file=sys.stderr)
            return 1
        rc = fetch(dest, version)
        if rc:
            return rc
    return 0


def fetch(dest: str, version: str) -> int:
    """Fetch and unpack ``vllm-version`` under ``dest`` (once)."""
    src = os.path.join(dest, f"vllm-{version}")
    if os.path.isfile(os.path.join(src, "vllm", "v1", "worker", "gpu", "states.py")):
        print(f"vLLM {version} source already at {src}")
        return 0
    os.makedirs(dest, exist_ok=True)
    page = _get(INDEX).decode()
    links = re.findall(rf'href="([^"]*vllm-{re.escape(version)}\.tar\.gz[^"]*)"', page)
    if not links:
        print(f"vllm-{version}.tar.gz not listed at {INDEX}", file=sys.stderr)
        return 1
    data = _get(urllib.parse.urljoin(INDEX, links[0].split("#")[0]))
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256[version]:
        print(f"sha256 mismatch for vllm-{version}.tar.gz: {digest}", file=sys.stderr)
        return 1
    archive = os.path.join(dest, f"vllm-{version}.tar.gz")
    with open(archive, "wb") as f:
        f.write(data)
    with tarfile.open(archive) as t:
        t.extractall(dest, filter="data")
    print(f"unpacked vLLM {version} source to {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
