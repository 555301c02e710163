"""Where a step's time goes inside the step kernel, phase by phase.

Builds a copy of mtpstate (in a temporary directory; the source tree is not
touched) whose step kernels read the CPU's cycle counter between their
phases (``llvm.readcyclecounter``, a handful of cycles each), records each
workload's steps from vLLM 0.34's scheduler (the timing workloads of mtpstate/tools/vllm_bench),
replays them through ``RequestTable.apply(so).batch`` with 8 MiB of other
memory traffic between steps, and prints the mean time per step of each
phase of the general step (``_general``) and of the update-only step
(``_update_only``), converted with the counter's rate measured against
``time.perf_counter``.

    python vllm_proof/phases.py --workload busy-1024 --workload steady-4096 [--json out.json]

Run with the vLLM tier's environment (``make test-vllm`` builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (text in step.py / decode.py the clock read goes before, phase that starts there)
GENERAL = (
    ("    nd, nn, st = _new_descriptors(", "new requests read (descriptors)"),
    ("    if fin != 0:\n        st = _check_freed(", "check finished and preempted"),
    ("    nk = _new_keys(nn)", "check new requests, assign rows"),
    ("    rk, nres, st = _resumed_keys(", "resumed ids"),
    ("    i_cid, i_cblk, st = _check_cached(", "check cached requests"),
    ("    if tb[TB_STG_ON] != 0 and sc[SC_NSTAGE]", "staging capacity"),
    ("    if nst != 0:\n        st = resolve_batch(", "batch: resolve"),
    ("    # the freed rows lowest first", "freed rows sorted, key arena"),
    ("    _ix_commit(", "apply: index (free rows, add keys)"),
    ("    res = view_i32(tb[TB_RES], 3 * R)", "apply: new requests"),
    ("    _forget_freed(", "apply: cached requests"),
    ("    tb[TB_RES_NC] = sc[SC_NC]", "batch: write"),
)
UPDATE = (
    ("    i_cid, nc, vk, vb, i_cblk, st = _open_cached(", "update pass"),
    ("    if staging and ns + nstage_blocks > stg_cap:", "steady batch"),
    ("    if nst != 0 and not steady:", "batch: resolve (not steady)"),
    ("    unchanged = sync and nc == prev_n", "block appends, prediction"),
    ("    tb[TB_RES_NC] = nc\n    tb[TB_STG_N] = ns\n    if steady:", "batch: publish"),
)
FIRST_UPDATE_SLOT = 16
CYCLES = """

@intrinsic
def cycles(typingctx):
    sig = types.int64()

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(_I64, []))
        return builder.call(fn, [])

    return sig, codegen
"""


def _clock(body: str, anchor: str, slot: int, last: bool = False) -> str:
    at = body.rindex(anchor) if last else body.index(anchor)
    return body[:at] + f"    _t = cycles()\n    tb[TB_PROF + {slot}] += _t\n" + body[at:]


def instrumented_copy(dst: str) -> None:
    """mtpstate with a clock read before each phase (and at the end) of the
    two step kernels, accumulated in extra slots of the table context."""
    shutil.copytree(os.path.join(ROOT, "mtpstate"), os.path.join(dst, "mtpstate"),
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    k = os.path.join(dst, "mtpstate", "_kernels")
    with open(os.path.join(k, "native.py"), "a") as f:
        f.write(CYCLES)
    path = os.path.join(k, "slots.py")
    text = open(path).read()
    size = int(text.split("\nTB_SIZE = ", 1)[1].split()[0])
    text = text.replace(f"\nTB_SIZE = {size}", f"\nTB_PROF = {size}\nTB_SIZE = {size + 32}")
    open(path, "w").write(text)
    header = "from __future__ import annotations\n"
    clock_imports = (
        header + "from mtpstate._kernels.native import cycles\n" + "from mtpstate._kernels.slots import TB_PROF\n"
    )
    path = os.path.join(k, "step.py")
    s = open(path).read().replace(header, clock_imports, 1)
    start = s.index("def _general(")
    body = s[start:]
    for slot, (anchor, _) in enumerate(GENERAL):
        body = _clock(body, anchor, slot)
    open(path, "w").write(s[:start] + _clock(body, "    return OK\n", len(GENERAL), last=True))
    path = os.path.join(k, "decode.py")
    s = open(path).read().replace(header, clock_imports, 1)
    start = s.index("def _update_only(")
    body = s[start:]
    for slot, (anchor, _) in enumerate(UPDATE):
        body = _clock(body, anchor, FIRST_UPDATE_SLOT + slot)
    open(path, "w").write(s[:start] + _clock(body, "    return OK\n", FIRST_UPDATE_SLOT + len(UPDATE), last=True))


def replay(pkg: str, path: str, repeats: int) -> dict:
    """Mean us per step of each phase (in a subprocess: the copy's import)."""
    code = f"""
import json, pickle, sys, time
import numpy as np
sys.path.insert(0, {pkg!r})
import numba
import mtpstate
from mtpstate._kernels import slots
from mtpstate._kernels.native import cycles
assert mtpstate.__file__.startswith({pkg!r})
P, U, NG, NU = slots.TB_PROF, {FIRST_UPDATE_SLOT}, {len(GENERAL)}, {len(UPDATE)}
d = pickle.load(open({path!r}, "rb"))
gen, upd, ng, nu = np.zeros(NG), np.zeros(NU), 0, 0
for rep in range({repeats} + 1):
    t = mtpstate.RequestTable(max_num_reqs=d["R"], max_model_len=d["L"], block_sizes=d["bs"], decode_query_len=d["dq"])
    for s, keep in zip([pickle.loads(b) for b in d["blobs"]], d["timed"]):
        junk = bytearray(8 << 20)
        del junk
        before = t._ctx[P:P + 32].copy()
        t.apply(s).batch.idx_mapping_np
        dd = t._ctx[P:P + 32] - before
        if not (keep and rep):
            continue
        if dd[0] and dd[NG]:
            gen += np.diff(dd[0:NG + 1]); ng += 1
        if dd[U] and dd[U + NU]:
            upd += np.diff(dd[U:U + NU + 1]); nu += 1
clock = numba.njit(lambda: cycles())
a, t0 = clock(), time.perf_counter()
time.sleep(0.5)
b, t1 = clock(), time.perf_counter()
ns_per_tick = (t1 - t0) * 1e9 / (b - a)
print(json.dumps({{"general": (gen * ns_per_tick / 1e3 / max(ng, 1)).tolist(), "general_steps": ng,
                  "update_only": (upd * ns_per_tick / 1e3 / max(nu, 1)).tolist(), "update_only_steps": nu}}))
"""
    env = dict(os.environ, MTPSTATE_COMPILE_NOTICE="0", NUMBA_CACHE_DIR=os.path.join(pkg, "numba-cache"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    from before_after import record

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        pkg = os.path.join(tmp, "pkg")
        instrumented_copy(pkg)
        record(args.workload, tmp)
        for name in args.workload:
            r = replay(pkg, os.path.join(tmp, f"{name}.pkl"), args.repeats)
            out = {"workload": name, "general_steps": r["general_steps"], "update_only_steps": r["update_only_steps"]}
            if r["general_steps"]:
                out["general_us"] = {ph: round(v, 2) for (_, ph), v in zip(GENERAL, r["general"])}
            if r["update_only_steps"]:
                out["update_only_us"] = {ph: round(v, 2) for (_, ph), v in zip(UPDATE, r["update_only"])}
            results.append(out)
            print(json.dumps(out), flush=True)
    if args.json:
        from mtpstate.tools.vllm_bench.bench import run_machine

        machine = run_machine()
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
