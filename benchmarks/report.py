"""The documentation's figures, generated from the committed benchmark results.

Every table of figures in README.md, docs/benchmarks.md and docs/vllm.md sits
between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` and is written
by this script from:

- ``docs/bench-cpu.json``: ``mtpstate bench --full --json ...`` (the kernel
  on mtpstate's own workloads);
- ``docs/bench-vllm.json`` and ``docs/bench-vllm-runner.json``: ``make
  bench-vllm``, i.e. ``mtpstate bench-vllm --level bookkeeping|runner
  --json ...`` in the vLLM venv (the whole bookkeeping and the runner's host
  step, on vLLM 0.34.0's real scheduler output);
- ``docs/bench-before-after.json``: ``vllm_proof/before_after.py``
  (the last performance change, paired, on the same recorded vLLM steps);
- ``docs/bench-vllm-breakdown.json``: ``harness.py --bench --runner
  --breakdown`` (the runner's host step with mtpstate on, method by method);
- ``docs/bench-phases.json``: ``vllm_proof/phases.py`` (the step
  kernel's time, phase by phase);
- ``docs/bench-device-cpu.json``: ``mtpstate bench --only device`` on the
  CPU; ``docs/bench-device-gpu.json``: the same on a GPU (``make
  gpu-check``'s ``bench-device.json``), when one has run.

A figure inside a sentence is generated the same way, between
``<!-- fig:SOURCE/WORKLOAD/FIELD[:FORMAT] -->`` and ``<!-- /fig -->``:
``SOURCE`` names a JSON file (``FIGURE_SOURCES``), ``WORKLOAD`` one of its
results, ``FIELD`` a dotted path into it (``phases_us.vllm.gather``), and
``FORMAT`` how it is written (``FORMATS``: ``x`` a ratio, ``us`` microseconds,
``int``, ``pct`` a share). ``tests/test_docs.py`` also fails on a figure
typed by hand in the prose.

Usage:
  python benchmarks/report.py --write     # rewrite the regions and figures in the docs
  python benchmarks/report.py --plots     # docs/img/runner.png, docs/img/bookkeeping.png (matplotlib)
  python benchmarks/report.py --check     # exit 1 if a region or figure differs from its JSON, or a figure
                                          # is typed by hand (tests/test_docs.py)
  python benchmarks/report.py NAME        # print one region
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
FILES = ("README.md", "docs/api.md", "docs/architecture.md", "docs/benchmarks.md", "docs/divergence.md", "docs/vllm.md")
_REGION = re.compile(r"(<!-- report:([\w-]+) -->\n)(.*?)(<!-- /report:\2 -->)", re.S)
_FIGURE = re.compile(r"(<!-- fig:([\w./:-]+) -->)(.*?)(<!-- /fig -->)", re.S)


def _load(name: str):
    with open(os.path.join(DOCS, name)) as f:
        d = json.load(f)
    return (d["machine"], d["results"]) if isinstance(d, dict) and "results" in d else (None, d)


def _n(workload: str) -> int:
    return int(workload.rsplit("-", 1)[1])


def _opt(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _x(r: float) -> str:
    return f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


def machine_line(m: dict | None) -> str:
    if m is None:
        return "Machine: not recorded."
    s = f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, numpy {m['numpy']}, numba {m['numba']}"
    s += f", torch {m.get('torch')}"
    if m.get("vllm"):
        s += f", vLLM {m['vllm']}"
    return s + f". Run {m.get('date', '(date not recorded)')}, mtpstate {m.get('mtpstate', '?')}."


# ----------------------------------------------------------------------------
# the three levels


def kernel_tables() -> str:
    """mtpstate bench: loop vs RequestTable on the own workloads."""
    d = json.load(open(os.path.join(DOCS, "bench-cpu.json")))
    res = d["results"]
    out = [machine_line(d["machine"]) + f" Kernel compile/cache-load before timing: {d['warmup_s'] * 1e3:.0f} ms.", ""]
    for wl in ("steady-decode", "steady-decode-fresh-ids", "mixed"):
        out += [
            f"**{wl}** (median us per step; speedup: ratio of medians; paired: median and p10-p90 of per-step ratios)",
            "",
            "| N | loop | RequestTable | speedup | paired |",
            "|---:|---:|---:|---:|---:|",
        ]
        for n in sorted({r["n"] for r in res if r["workload"] == wl}):
            g = {r["impl"]: r for r in res if r["workload"] == wl and r["n"] == n}
            v, lp = g["vectorized"], g["loop"]
            out.append(
                f"| {n} | {lp['median_us']:.1f} | {v['median_us']:.1f} | **{_x(v['speedup'])}** | "
                f"{_x(v['paired_speedup_median'])} ({v['paired_speedup_p10']:.1f}-{v['paired_speedup_p90']:.1f}) |"
            )
        out.append("")
    out += [
        "**id lookup, freshly unpickled ids** (median us per batch)",
        "",
        "| N | dict + fromiter | RequestIndex.lookup | speedup | paired |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({r["n"] for r in res if r["workload"].startswith("index")}):
        g = {r["impl"]: r for r in res if r["workload"].startswith("index") and r["n"] == n}
        x = g["index"]
        out.append(
            f"| {n} | {g['dict']['median_us']:.2f} | {x['median_us']:.2f} | **{_x(x['speedup'])}** | "
            f"{_x(x['paired_speedup_median'])} ({x['paired_speedup_p10']:.2f}-{x['paired_speedup_p90']:.2f}) |"
        )
    return "\n".join(out).rstrip()


# the workload kinds of `mtpstate bench-vllm`, in the tables' order
KINDS = ("steady", "busy", "chunked")
KIND_TITLES = {
    "steady": "steady decode",
    "busy": "busy (arrivals and finishes every step)",
    "chunked": "chunked prefill (long prompts beside the decodes)",
}


def bookkeeping_table() -> str:
    """vLLM's finish/add/update + gather_batch_req_state vs apply(so).batch."""
    m, res = _load("bench-vllm.json")
    by = {r["workload"]: r for r in res}
    sizes = sorted({_n(w) for w in by})
    out = [
        machine_line(m),
        "",
        "| N | " + " | ".join(f"{k}: vLLM vs mtpstate, us | speedup (paired median, p10-p90)" for k in KINDS)
        + " | apply alone, steady, ns per request |",
        "|---:|" + "---:|---:|" * len(KINDS) + "---:|",
    ]  # fmt: skip
    for n in sizes:
        cells = [str(n)]
        for kind in KINDS:
            r = by.get(f"{kind}-{n}")
            if r is None:
                cells += ["-", "-"]
                continue
            cells.append(f"{r['mrv2_median_us']:.1f} vs {r['mtpstate_median_us']:.1f}")
            cells.append(
                f"**{_x(r['speedup'])}** ({_x(r['paired_median'])}, {r['paired_p10']:.1f}-{r['paired_p90']:.1f})"
            )
        s = by.get(f"steady-{n}")
        cells.append("-" if s is None else f"{s['apply_alone_ns_per_request']:.0f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


RUNNER_ORDER = KINDS


def runner_table(results: list[dict] | None = None) -> str:
    """The runner's host step, vLLM's methods (off) vs mtpstate through the
    plugin (on), one row per workload, from ``mtpstate bench-vllm --level runner``."""
    if results is None:
        results = _load("bench-vllm-runner.json")[1]
    phases = list(results[0]["phases_us"]["vllm"])  # (in the bench's PHASES order, as it wrote them)
    rows = [
        "| workload | max running | off (vLLM), us | on (mtpstate), us | speedup (paired median, p10-p90) "
        f"| off: {' / '.join(phases)}, us | on: the same, us "
        "| input preparation (gather + prepare_inputs + prepare_attn): off vs on, us, paired median (p10-p90) "
        "| the sampler's per-step questions: off vs on, us, paired median (p10-p90) "
        "| bookkeeping with the sampler (all but prepare_inputs / prepare_attn): off vs on, us, paired median "
        "(p10-p90) "
        "| mtpstate's sampler answers per step, us: median / p90 (batches from the counts) "
        "| torch ops off | torch ops on | launches off | launches on |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    key = lambda r: (RUNNER_ORDER.index(r["workload"].split("-")[0]), _n(r["workload"]))  # noqa: E731
    for r in sorted(results, key=key):
        ph, ops = r["phases_us"], r["torch_ops"]
        cells = [r["workload"], str(r["max_running"]), f"{r['vllm_median_us']:.0f}", f"{r['mtpstate_median_us']:.0f}"]
        cells.append(
            f"**{r['speedup']:.2f}x** ({r['paired_median']:.2f}x, {r['paired_p10']:.2f}-{r['paired_p90']:.2f})"
        )
        for side in ("vllm", "mtpstate"):
            cells.append(" / ".join(f"{ph[side][k]:.0f}" for k in phases))
        for ip in (r["input_preparation"], r.get("sample_questions"), r.get("bookkeeping_and_sampler")):
            cells.append(
                "-"
                if ip is None
                else f"{ip['vllm_median_us']:.0f} vs {ip['mtpstate_median_us']:.0f}: **{ip['paired_median']:.2f}x** "
                f"({ip['paired_p10']:.2f}-{ip['paired_p90']:.2f})"
            )
        a = r.get("sampler_answers_us")
        cells.append("-" if a is None else f"{a['median']:.2f} / {a['p90']:.2f} ({a['from_counts']:.0%})")
        for side in ("vllm", "mtpstate"):
            o = ops[side]
            cells.append(f"{_opt(o['without_new'])} / {_opt(o['with_new'])} (max {o['max']})")
        for side in ("vllm", "mtpstate"):
            n = ops[side].get("cuda_launches") or ops[side]["no_op_launches"]
            cells.append(f"{_opt(n['without_new'])} / {_opt(n['with_new'])}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def runner_summary() -> str:
    m, res = _load("bench-vllm-runner.json")
    by = {r["workload"]: r for r in res}
    out = [
        machine_line(m),
        "",
        "| N | " + " | ".join(f"{k}: vLLM vs mtpstate, us | speedup (paired median, p10-p90)" for k in KINDS) + " |",
        "|---:|" + "---:|---:|" * len(KINDS),
    ]
    for n in sorted({_n(w) for w in by}):
        cells = [str(n)]
        for kind in KINDS:
            r = by.get(f"{kind}-{n}")
            if r is None:
                cells += ["-", "-"]
                continue
            cells.append(f"{r['vllm_median_us']:.0f} vs {r['mtpstate_median_us']:.0f}")
            cells.append(
                f"**{r['speedup']:.2f}x** ({r['paired_median']:.2f}x, {r['paired_p10']:.2f}-{r['paired_p90']:.2f})"
            )
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def shadow_table() -> str:
    """Shadow mode's host cost per step, per workload kind and N, from the
    runner level of ``mtpstate bench-vllm`` (its ``shadow`` entry)."""
    m, res = _load("bench-vllm-runner.json")
    by = {r["workload"]: r for r in res}
    every = next((r["shadow"]["every"] for r in res if r.get("shadow")), None)
    out = [
        machine_line(m),
        "",
        "| workload | N | vLLM's host step, us | shadow: median / mean / p90, us "
        f"| shadow, a step with a device check (every {every}), us "
        "| vLLM + shadow over vLLM: paired median (p10-p90) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        for n in sorted(_n(w) for w in by if w.startswith(kind + "-")):
            sh = by[f"{kind}-{n}"].get("shadow")
            if sh is None:
                continue
            out.append(
                f"| {kind} | {n} | {sh['vllm_median_us']:.0f} | {sh['shadow_median_us']:.0f} / "
                f"{sh['shadow_mean_us']:.0f} / {sh['shadow_p90_us']:.0f} | {_opt(sh['shadow_device_check_median_us'])} "
                f"| **{_x(sh['overhead_paired_median'])}** ({sh['overhead_paired_p10']:.2f}-"
                f"{sh['overhead_paired_p90']:.2f}) |"
            )
    return "\n".join(out)


def _release_runs() -> list[tuple[str, dict, list[dict]]]:
    """(vLLM release, machine, runner results) of each committed
    ``bench-vllm-runner-RELEASE.json`` (one per supported release, run back
    to back by ``make bench-vllm``), newest first."""
    runs = []
    for name in os.listdir(DOCS):
        if name.startswith("bench-vllm-runner-") and name.endswith(".json"):
            m, res = _load(name)
            runs.append((name[len("bench-vllm-runner-") : -len(".json")], m, res))
    return sorted(runs, key=lambda r: tuple(int(x) for x in r[0].split(".")), reverse=True)


def releases_table() -> str:
    """The runner's host step, with vLLM's Sampler, on each supported vLLM
    release, side by side at the N every run measured."""
    runs = _release_runs()
    sizes = sorted(set.intersection(*({_n(r["workload"]) for r in res} for _, _, res in runs)))
    out = [line for _, m, _ in runs for line in (machine_line(m), "")]
    head = ["workload", "N"]
    for release, _, _ in runs:
        head += [f"vLLM {release}: off vs on, us", "speedup (paired median, p10-p90)"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|---|---:|" + "---:|---:|" * len(runs))
    for kind in KINDS:
        for n in sizes:
            cells = [kind, str(n)]
            for _, _, res in runs:
                r = next((x for x in res if x["workload"] == f"{kind}-{n}"), None)
                if r is None:
                    cells += ["-", "-"]
                    continue
                cells.append(f"{r['vllm_median_us']:.0f} vs {r['mtpstate_median_us']:.0f}")
                cells.append(f"**{_x(r['paired_median'])}** ({r['paired_p10']:.2f}-{r['paired_p90']:.2f})")
            out.append("| " + " | ".join(cells) + " |")
    # each release's paired median against the newest one's spread, row by row
    newest = {r["workload"]: r for r in runs[0][2]}
    for release, _, res in runs[1:]:
        rows = [(r, newest[r["workload"]]) for r in res if r["workload"] in newest]
        inside = sum(
            a["paired_p10"] <= b["paired_median"] <= a["paired_p90"]
            and b["paired_p10"] <= a["paired_median"] <= b["paired_p90"]
            for a, b in rows
        )
        out.append("")
        out.append(
            f"vLLM {release} against {runs[0][0]}: in {inside} of {len(rows)} rows each release's paired median "
            "lies within the other's p10-p90 spread."
        )
    return "\n".join(out)


def headline() -> str:
    """README: one row per N, each level's paired-median speedup."""
    cpu = json.load(open(os.path.join(DOCS, "bench-cpu.json")))["results"]
    kern = {r["n"]: r for r in cpu if r["workload"] == "steady-decode" and r["impl"] == "vectorized"}
    book = {r["workload"]: r for r in _load("bench-vllm.json")[1]}
    run = {r["workload"]: r for r in _load("bench-vllm-runner.json")[1]}
    sizes = sorted({_n(w) for w in run} | {_n(w) for w in book})
    out = [
        "| running requests | own steady decode: kernel vs loop | vLLM's steps, bookkeeping: steady / busy / chunked "
        "| vLLM's runner with its Sampler, host step: steady / busy / chunked |",
        "|---:|---:|---:|---:|",
    ]

    def cell(d, k):
        return _x(d[k]["paired_median"]) if k in d else "-"

    for n in sizes:
        k = f"{_x(kern[n]['paired_speedup_median'])}" if n in kern else "-"
        b = " / ".join(cell(book, f"{kind}-{n}") for kind in KINDS)
        r = " / ".join(cell(run, f"{kind}-{n}") for kind in KINDS)
        out.append(f"| {n} | {k} | {b} | {r} |")
    return "\n".join(out)


def before_after() -> str:
    """The last performance change: old vs new tree, paired per step."""
    with open(os.path.join(DOCS, "bench-before-after.json")) as f:
        d = json.load(f)
    lines = [
        machine_line(d["machine"]),
        "",
        f"Before: {d['old']}; after: {d['new']}.",
        "",
        "| workload | before, us | after, us | after vs before (paired median, p10-p90) | steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in d["results"]:
        lines.append(
            f"| {r['workload']} | {r['old_median_us']:.1f} | {r['new_median_us']:.1f} | "
            f"**{_x(r['paired_median'])}** ({r['paired_p10']:.2f}-{r['paired_p90']:.2f}) | {r['steps']} |"
        )
    return "\n".join(lines)


def breakdown_table() -> str:
    """The runner's host step with mtpstate on, by method (busy and steady)."""
    m, res = _load("bench-vllm-breakdown.json")
    names = [k for k in res[0]["breakdown_us"] if k != "total"]
    lines = [machine_line(m), "", "| part, us per step (median) | " + " | ".join(r["workload"] for r in res) + " |"]
    lines.append("|---|" + "---:|" * len(res))
    for k in [*names, "total"]:
        label = k.strip() if k != "total" else "**total**"
        lines.append(f"| {label} | " + " | ".join(f"{r['breakdown_us'][k]:.1f}" for r in res) + " |")
    return "\n".join(lines)


def phases_table() -> str:
    """The step kernel's time per step, phase by phase."""
    m, res = _load("bench-phases.json")
    lines = [machine_line(m), ""]
    for kind, title in (("general_us", "general step"), ("update_only_us", "update-only step")):
        rows = [r for r in res if kind in r]
        if not rows:
            continue
        lines.append(f"| {title}, us per step (mean) | " + " | ".join(r["workload"] for r in rows) + " |")
        lines.append("|---|" + "---:|" * len(rows))
        for ph in rows[0][kind]:
            lines.append(f"| {ph} | " + " | ".join(f"{r[kind][ph]:.1f}" for r in rows) + " |")
        lines.append("| **sum** | " + " | ".join(f"**{sum(r[kind].values()):.1f}**" for r in rows) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def device_table(name: str, how: str) -> str:
    """``mtpstate bench --only device``: apply without and with the mirror,
    until it lands, and vLLM's way of uploading the same step."""
    path = os.path.join(DOCS, name)
    if not os.path.exists(path):
        return f"Not measured yet: {how}; committed as `docs/{name}`, this table is generated from it."
    with open(path) as f:
        d = json.load(f)
    m, dev = d["machine"], d["device"]
    facts = dev["facts"]
    lines = [
        machine_line(m),
        f"Device: {m['mirror_device']}; mirror path: {facts['mirror_path']}; vLLM's way: {facts['vllm_way']}.",
        "Median us per step; paired: median (p10-p90) of the per-step differences (us) or ratios.",
        "",
        "| step | N | apply, no mirror | apply with mirror | with - without (paired) | mirror lands | lands - apply "
        "(paired) | vLLM-way lands | vLLM-way / mirror lands (paired) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def p(v, unit=""):
        return f"{v['median']:.1f}{unit} ({v['p10']:.1f}-{v['p90']:.1f})"

    for r in dev["results"]:
        ratio = r["vllm_way_over_mirror_lands"]
        lines.append(
            f"| {r['workload']} | {r['n']} | {r['host']['median_us']:.1f} | {r['mirror']['median_us']:.1f} "
            f"| {p(r['mirror_minus_host_us'])} | {r['mirror-lands']['median_us']:.1f} "
            f"| {p(r['lands_minus_mirror_us'])} | {r['vllm-way-lands']['median_us']:.1f} "
            f"| **{_x(ratio['median'])}** ({ratio['p10']:.2f}-{ratio['p90']:.2f}) |"
        )
    return "\n".join(lines)


def serving_table(name: str, how: str) -> str:
    """``mtpstate bench --only device``'s serving part: the mirror at vLLM's
    sizes, its memory, and what it allocates and captures while serving."""
    path = os.path.join(DOCS, name)
    if not os.path.exists(path):
        return f"Not measured yet: {how}; committed as `docs/{name}`, this table is generated from it."
    with open(path) as f:
        d = json.load(f)
    s = d["device"].get("serving")
    if s is None:
        return f"Not measured yet: `docs/{name}` predates the serving part of `mtpstate bench --only device`."
    c, mib = s["config"], 2**20

    def size(b):
        return "-" if b is None else f"{b / mib:.1f} MiB"

    def spread(v):
        return f"{v['median']:.0f} / {v['max']:.0f} us"

    rows = [
        ("staged elements a slot holds (any step's, token ids apart)", f"{s['staging_capacity']:,}"),
        ("token ids a slot's token area holds; overflow chunks", f"{s['token_chunk']:,}; {s['overflow_chunks']}"),
        ("pinned host memory (staging)", size(s["pinned_bytes"])),
        ("device memory (mirrored tensors, staging, graph pool)", size(s["device_bytes"])),
        ("of which the graphs' memory pool", size(s["graph_pool_bytes"])),
        ("what one step can carry (12 bytes an element, R new requests' token ids)", size(s["step_bytes_bound"])),
        ("graphs captured when the table is built", f"{s['captures_built']}"),
        ("captures / allocations while serving", f"{s['captures_serving']} / {s['allocations_serving']}"),
        ("growth of torch.cuda.memory_reserved() while serving", size(s["reserved_growth_bytes"])),
        ("apply, host time per step: median / slowest", spread(s["apply_us"])),
        ("until the step's device work has run: median / slowest", spread(s["lands_us"])),
    ]
    lines = [
        machine_line(d["machine"]),
        f"R = {c['max_num_reqs']}, L = {c['max_model_len']}, {c['block_size']}-token blocks, the vLLM adapter's "
        f"configuration; {c['steps']} busy steps of {c['prompt_len'][0]}-{c['prompt_len'][1]}-token prompts "
        f"({c['arrivals']} arrivals); device: {s['device']}, {s['path']} path.",
        "",
        "| | |",
        "|---|---:|",
        *(f"| {k} | {v} |" for k, v in rows),
    ]
    return "\n".join(lines)


GPU_ACCEPTANCE = "gpu-acceptance"  # docs/gpu-acceptance/: what gpu_acceptance/run.sh wrote under OUT


def gpu_acceptance() -> str:
    """The GPU acceptance run (``gpu_acceptance/run.sh OUT``, its JSON files
    committed under ``docs/gpu-acceptance/``): the machine, every part's
    verdict, and the runner's host step on the GPU beside the CPU's."""
    folder = os.path.join(DOCS, GPU_ACCEPTANCE)
    path = os.path.join(folder, "summary.json")
    if not os.path.exists(path):
        return (
            "Not run on a GPU yet: `gpu_acceptance/run.sh OUT` on a CUDA machine writes `OUT/summary.json` and the "
            f"parts' JSON files; committed under `docs/{GPU_ACCEPTANCE}/`, this section is generated from them."
        )
    with open(path) as f:
        s = json.load(f)
    m = s["machine"]
    out = [
        f"Run {m['date']} on {m.get('gpu', 'no GPU')}, driver {m.get('driver', '-')}, torch {m.get('torch')} "
        f"(CUDA {m.get('cuda')}), numba {m.get('numba')}, Python {m['python']}.",
        "",
        "| part | verdict | seconds | detail |",
        "|---|---|---:|---|",
    ]
    for p in s["parts"]:
        out.append(f"| {p['part']} | {p['status']} | {p['seconds']:.1f} | {p['detail'].replace('|', '/')} |")
    runner = os.path.join(folder, "bench-vllm-runner.json")
    if os.path.exists(runner):
        with open(runner) as f:
            gpu = {r["workload"]: r for r in json.load(f)["results"]}
        cpu = {r["workload"]: r for r in _load("bench-vllm-runner.json")[1]}
        out += [
            "",
            "The runner's host step with vLLM's Sampler, paired median speedup (p10-p90), on this GPU beside the "
            "CPU figures above:",
            "",
            "| workload | GPU: vLLM vs mtpstate, us | GPU speedup | CPU speedup |",
            "|---|---:|---:|---:|",
        ]
        for w, r in sorted(gpu.items(), key=lambda kv: (kv[0].split("-")[0], _n(kv[0]))):
            c = cpu.get(w)
            out.append(
                f"| {w} | {r['vllm_median_us']:.0f} vs {r['mtpstate_median_us']:.0f} "
                f"| **{r['paired_median']:.2f}x** ({r['paired_p10']:.2f}-{r['paired_p90']:.2f}) "
                f"| {'-' if c is None else format(c['paired_median'], '.2f') + 'x'} |"
            )
    return "\n".join(out)


def cli_example() -> str:
    """README: what ``mtpstate bench-vllm`` prints for one row (busy-16 of
    the committed runner run), through the command's own formatter."""
    from mtpstate.tools.bench_vllm import table_header, table_row

    by = {r["workload"]: r for r in _load("bench-vllm-runner.json")[1]}
    return "```\n" + table_header() + "\n" + table_row(by["busy-16"]) + "\n```"


REGIONS = {
    "headline": headline,
    "cli-example": cli_example,
    "kernel": kernel_tables,
    "bookkeeping": bookkeeping_table,
    "runner-summary": runner_summary,
    "runner": runner_table,
    "shadow": shadow_table,
    "releases": releases_table,
    "before-after": before_after,
    "breakdown": breakdown_table,
    "phases": phases_table,
    "device-cpu": lambda: device_table("bench-device-cpu.json", "`mtpstate bench --only device --json F` writes it"),
    "device-gpu": lambda: device_table("bench-device-gpu.json", "`make gpu-check` writes `bench-device.json`"),
    "serving-cpu": lambda: serving_table("bench-device-cpu.json", "`mtpstate bench --only device --json F` writes it"),
    "serving-gpu": lambda: serving_table("bench-device-gpu.json", "`make gpu-check` writes `bench-device.json`"),
    "gpu-acceptance": gpu_acceptance,
}


# ----------------------------------------------------------------------------
# plots


def plots() -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    written = []
    for name, title, data, off_key, on_key in (
        (
            "runner.png",
            "vLLM's runner: host part of execute_model up to the forward",
            _load("bench-vllm-runner.json"),
            "vllm_median_us",
            "mtpstate_median_us",
        ),
        (
            "bookkeeping.png",
            "Request-state bookkeeping on vLLM's real steps (finish/add/update + batch)",
            _load("bench-vllm.json"),
            "mrv2_median_us",
            "mtpstate_median_us",
        ),
    ):
        m, res = data
        fig, axes = plt.subplots(1, len(KINDS), figsize=(5.5 * len(KINDS), 4.2), sharey=True)
        for ax, kind in zip(axes, KINDS):
            rs = sorted((r for r in res if r["workload"].startswith(kind + "-")), key=lambda r: _n(r["workload"]))
            ns = [_n(r["workload"]) for r in rs]
            ax.plot(ns, [r[off_key] for r in rs], "o-", color="tab:gray", label="vLLM 0.34.0")
            ax.plot(ns, [r[on_key] for r in rs], "o-", color="tab:blue", label="with mtpstate")
            for x, r in zip(ns, rs):
                ax.annotate(f"{r['paired_median']:.1f}x", (x, r[on_key]), textcoords="offset points",
                            xytext=(0, -14), ha="center", fontsize=8, color="tab:blue")  # fmt: skip
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_ylim(0.4 * min(r[on_key] for r in res), 1.5 * max(r[off_key] for r in res))  # room for labels
            ax.set_xlabel("running requests (N)")
            ax.set_title(KIND_TITLES[kind])
            ax.grid(True, which="major", alpha=0.3)
        axes[0].set_ylabel("median us per step (log)")
        axes[0].legend(loc="upper left")
        fig.suptitle(title + "\n(labels: paired median speedup)", fontsize=10)
        foot = machine_line(m).replace("Machine: ", "")
        fig.text(0.5, 0.005, foot, ha="center", fontsize=7, color="0.4")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(DOCS, "img", name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ----------------------------------------------------------------------------
# figures inside sentences

FIGURE_SOURCES = {
    "runner": "bench-vllm-runner.json",
    "bookkeeping": "bench-vllm.json",
    "breakdown": "bench-vllm-breakdown.json",
    "cpu": "bench-cpu.json",
}

FORMATS = {
    "x": _x,
    "us": lambda v: f"{v:.0f} us",
    "int": lambda v: f"{v:.0f}",
    "pct": lambda v: f"{100 * v:.0f}%",
}


def _breakdown_part(r: dict, *parts: str) -> float:
    b = r["breakdown_us"]
    apply_us = b["  of add_requests: RequestTable.apply"]
    named = {"apply": apply_us, "hooks": b["finish_requests"] + b["add_requests"] - apply_us}
    return sum(named[p] if p in named else b[p] for p in parts) / b["total"]


# figures computed from a result (FIELD names one of these, else a path)
DERIVED = {
    "breakdown": {
        # vLLM's per-request hooks: finish_requests' removal hooks, add_requests' around apply
        "hooks_share": lambda r: _breakdown_part(r, "hooks"),
        "apply_share": lambda r: _breakdown_part(r, "apply"),
        "prepare_share": lambda r: _breakdown_part(r, "prepare_inputs", "prepare_attn"),
    },
}


def figure(spec: str) -> str:
    """The text of figure ``SOURCE/WORKLOAD/FIELD[:FORMAT]`` (see the module
    docstring); KeyError for a name that does not resolve."""
    path, _, fmt = spec.partition(":")
    source, workload, field = path.split("/", 2)
    _, results = _load(FIGURE_SOURCES[source])
    matches = [r for r in results if r.get("workload") == workload]
    if len(matches) != 1:
        raise KeyError(f"{spec}: {len(matches)} results for workload {workload!r} in {FIGURE_SOURCES[source]}")
    value = matches[0]
    derived = DERIVED.get(source, {}).get(field)
    if derived is not None:
        value = derived(value)
    else:
        for key in field.split("."):
            value = value[key]
    return FORMATS[fmt or "x"](value)


# a number with a unit of time, a ratio or a share, in the prose (outside
# the generated regions and figures, code blocks and inline code)
_MEASURED = re.compile(r"(?<![\w.\-])~?\d[\d,.]*(?:\s?-\s?\d[\d,.]*)?\s?(?:x|us|ns|ms|s|%)(?![\w])")
# such numbers that state a workload's input, not a result: (file, the
# sentence's words around it)
INPUTS = {
    ("docs/benchmarks.md", "a new block for ~25% of requests"),  # steady-decode's block appends
    ("docs/benchmarks.md", "for ~25% of requests a block append"),  # (the same workload)
    ("docs/benchmarks.md", "Requests carry a mix of sampling params"),  # SAMPLING_MIX's shares
}


def hand_typed(rel: str, text: str) -> list[str]:
    """The measured-looking numbers typed by hand in ``text`` (file ``rel``):
    each paragraph's numbers with a unit, unless the paragraph states a
    workload's input (:data:`INPUTS`)."""
    text = _REGION.sub("", text)
    text = _FIGURE.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for para in re.split(r"\n\s*\n", text):
        words = " ".join(para.split())
        if any(f == rel and phrase in words for f, phrase in INPUTS):
            continue
        out += [f"{rel}: {m.group(0)!r} typed by hand in: {words[:80]}..." for m in _MEASURED.finditer(words)]
    return out


def _figures_rewritten(text: str) -> str:
    return _FIGURE.sub(lambda m: m.group(1) + figure(m.group(2)) + m.group(4), text)


# ----------------------------------------------------------------------------
# the docs' regions


def _rewrite(text: str) -> str:
    text = _REGION.sub(lambda m: m.group(1) + REGIONS[m.group(2)]() + "\n" + m.group(4), text)
    return _figures_rewritten(text)


def check() -> list[str]:
    """The regions and figures whose text differs from what the JSON gives
    (``file: region`` or ``file: fig NAME``), figures that name nothing, and
    measured-looking numbers typed by hand (:func:`hand_typed`)."""
    bad = []
    for rel in FILES:
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        for m in _REGION.finditer(text):
            if m.group(3) != REGIONS[m.group(2)]() + "\n":
                bad.append(f"{rel}: {m.group(2)}")
        for m in _FIGURE.finditer(text):
            try:
                want = figure(m.group(2))
            except (KeyError, ValueError, TypeError) as e:
                bad.append(f"{rel}: fig {m.group(2)} names nothing ({e})")
                continue
            if m.group(3) != want:
                bad.append(f"{rel}: fig {m.group(2)}")
        bad += hand_typed(rel, text)
    return bad


def write() -> None:
    for rel in FILES:
        path = os.path.join(ROOT, rel)
        with open(path) as f:
            text = f.read()
        new = _rewrite(text)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"rewrote {rel}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "--write":
        write()
    elif argv[0] == "--plots":
        for p in plots():
            print(f"wrote {os.path.relpath(p, ROOT)}")
    elif argv[0] == "--check":
        bad = check()
        for b in bad:
            print(
                f"differs from its JSON: {b} (run: python benchmarks/report.py --write; a figure typed by hand: "
                "make it a <!-- fig:... --> or a region)"
            )
        return 1 if bad else 0
    elif argv[0] in REGIONS:
        print(REGIONS[argv[0]]())
    else:
        print(f"unknown region {argv[0]!r}; one of {', '.join(REGIONS)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
