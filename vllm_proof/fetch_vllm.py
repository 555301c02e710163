"""Fetch vLLM 0.34.0's sdist from the package index and unpack it (nothing is
built: ``pip download`` would run its metadata build, which needs a Rust
toolchain). The archive's sha256 is pinned.

Usage: python vllm_proof/fetch_vllm.py DEST_DIR
"""

import hashlib
import os
import re
import sys
import tarfile
import time
import urllib.parse
import urllib.request

VERSION = "0.34.0"
SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
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


def main(dest: str) -> int:
    src = os.path.join(dest, f"vllm-{VERSION}")
    if os.path.isfile(os.path.join(src, "vllm", "v1", "worker", "gpu", "states.py")):
        print(f"vLLM {VERSION} source already at {src}")
        return 0
    os.makedirs(dest, exist_ok=True)
    page = _get(INDEX).decode()
    links = re.findall(rf'href="([^"]*vllm-{re.escape(VERSION)}\.tar\.gz[^"]*)"', page)
    if not links:
        print(f"vllm-{VERSION}.tar.gz not listed at {INDEX}", file=sys.stderr)
        return 1
    data = _get(urllib.parse.urljoin(INDEX, links[0].split("#")[0]))
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        print(f"sha256 mismatch for vllm-{VERSION}.tar.gz: {digest}", file=sys.stderr)
        return 1
    archive = os.path.join(dest, f"vllm-{VERSION}.tar.gz")
    with open(archive, "wb") as f:
        f.write(data)
    with tarfile.open(archive) as t:
        t.extractall(dest, filter="data")
    print(f"unpacked vLLM {VERSION} source to {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
