"""``mtpstate bench-vllm``: mtpstate against the vLLM installed beside it, on
that vLLM's own scheduler steps, at two levels (the request-state
bookkeeping; the runner's host step up to the forward), on CPU (vLLM's
device work shimmed) or CUDA (nothing shimmed but what a vLLM without its
compiled ops lacks). The environment is checked before any work starts.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import replace

LEVELS = ("bookkeeping", "runner")
DEVICES = ("cpu", "cuda")
# --quick: one size, a few steps, two repeats: a minute with the first compile
QUICK_SIZES = (16,)
QUICK_STEPS = 20
QUICK_REPEATS = 2
DEFAULT_REPEATS = 5

# what the CPU run replaces of vLLM (mtpstate.tools.vllm_bench.shims), as the report names it
VLLM_CPU_SHIMS = (
    "platform: vLLM's unspecified platform as a CPU device",
    "UVA buffers: CPU tensors (as vLLM's CPU runner)",
    "staged-write kernel (buffer_utils): numpy",
    "Triton kernels of prepare_inputs / prepare_attn: counted no-ops (expand_idx_mapping's outputs written "
    "in numpy, untimed, for the sampler's gathers)",
    "the sampler's Triton launchers (temperature, min-p, penalties, logit bias, bad words, thinking budget): "
    "counted no-ops",
)
# and what the benchmark's CPU run replaces of mtpstate (on both sides: vLLM's launches are no-ops too)
CPU_SHIMS = (*VLLM_CPU_SHIMS, "the mirror's device step (one graph replay): a counted no-op")
# both sides: vllm.envs cached, as a serving vLLM process caches it once started
ENVS_NOTE = "vllm.envs cached (enable_envs_cache), as in a serving process"

CPU_NOTE = f"device launches are no-ops on the CPU: each side's figure is its host work up to the launches; {ENVS_NOTE}"


CUDA_NOTE = (
    "launches, copies and the mirror's device work run on the GPU; the device is drained after each side's step, "
    f"untimed; {ENVS_NOTE}"
)


class UnusableEnvironment(Exception):
    """This environment cannot run the benchmark (no vLLM, an unsupported
    one, no CUDA for ``--device cuda``): one line, raised before any work."""


def check_environment(device: str) -> dict:
    """What the run measures, checked before it starts: vLLM importable and a
    release mtpstate supports, torch, and CUDA where ``device`` asks for it.

    Returns
    -------
    dict
        ``{"version": ..., "path": ...}`` of the vLLM found.

    Raises
    ------
    UnusableEnvironment
        With the one line to show.
    """
    from mtpstate.integrations.vllm import plugin

    if device not in DEVICES:
        raise UnusableEnvironment(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    where = f"Python {sys.executable}"
    if importlib.util.find_spec("vllm") is None:
        raise UnusableEnvironment(
            f"vLLM is not installed in this environment ({where}); run this in the environment vLLM serves from"
        )
    version = plugin._version()
    if version is None:
        raise UnusableEnvironment(f"vLLM is installed ({where}) but `import vllm.version` fails")
    if version.split("+")[0] not in plugin.SUPPORTED:
        raise UnusableEnvironment(
            f"vLLM {version} is not a supported version (supported: {', '.join(plugin.SUPPORTED)}); "
            "upgrade mtpstate, or run this beside a supported vLLM"
        )
    if importlib.util.find_spec("torch") is None:
        raise UnusableEnvironment(f"torch is not installed in this environment ({where}); vLLM needs it")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            build = torch.version.cuda or "no CUDA (a CPU build)"
            raise UnusableEnvironment(
                f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device; run on a GPU machine, "
                "or leave --device at cpu"
            )
    import vllm

    return {"version": version, "path": os.path.dirname(os.path.abspath(vllm.__file__))}


def run(
    vllm_info: dict,
    device: str = "cpu",
    kinds: tuple[str, ...] | None = None,
    sizes: tuple[int, ...] | None = None,
    levels: tuple[str, ...] = LEVELS,
    repeats: int | None = None,
    quick: bool = False,
    sampler: bool = True,
    shims: tuple[str, ...] | None = None,
    on_result=None,
) -> dict:
    """Run the benchmark: every workload kind x size x level, paired.

    Parameters
    ----------
    vllm_info
        What :func:`check_environment` returned (call it first).
    device
        "cpu": vLLM's device work shimmed (``CPU_SHIMS``); "cuda": nothing
        shimmed, both sides' launches and copies real.
    kinds, sizes
        Workload kinds (``BENCH_KINDS``) and running-request counts
        (``BENCH_SIZES``); None: all (``quick``: ``QUICK_SIZES``).
    levels
        Among ``LEVELS``.
    repeats
        Passes over the recorded steps (None: 5; ``quick``: 2).
    quick
        One size, ``QUICK_STEPS`` steps per workload, two repeats.
    sampler
        Runner level: vLLM's real ``Sampler`` (and prompt-logprobs worker)
        attached on both sides, requests with the driver's sampling-params
        mix (``workloads.SAMPLING_MIX``), the sampler's per-step questions
        timed as the ``sample`` phase; False: no sampler on either side.
    shims
        What :func:`prepare` returned, if called already (None: it is called
        here).
    on_result
        Called with each result as it is measured.

    Returns
    -------
    dict
        ``{"machine", "vllm", "device", "shims", "note", "results"}``, each
        result with its ``level``: what ``--json`` writes.
    """
    from mtpstate.tools.vllm_bench.bench import bench_workload, run_machine
    from mtpstate.tools.vllm_bench.reference import cache_envs, load_plugin
    from mtpstate.tools.vllm_bench.workloads import BENCH_KINDS, BENCH_SIZES, sized_workload, write_model_dir

    kinds = tuple(kinds or BENCH_KINDS)
    sizes = tuple(sizes or (QUICK_SIZES if quick else BENCH_SIZES))
    repeats = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    if shims is None:
        shims = prepare(device)
    load_plugin()  # through vLLM's own plugin loader, as every vLLM process with VLLM_USE_MTPSTATE=1
    cache_envs()  # as a serving vLLM does once started
    model_dir = write_model_dir()
    results = []
    for level in levels:
        for kind in kinds:
            for n in sizes:
                w = sized_workload(kind, n)
                if quick:
                    w = replace(w, steps=min(w.steps, QUICK_STEPS))
                t0 = time.perf_counter()
                runner = level == "runner"
                r = bench_workload(w, model_dir, repeats=repeats, runner=runner, device=device, sampler=sampler)
                r.update(level=level, n=n, seconds=time.perf_counter() - t0)
                results.append(r)
                if on_result is not None:
                    on_result(r)
    return {
        "machine": run_machine(device),
        "vllm": vllm_info,
        "device": device,
        "shims": list(shims),
        "note": CPU_NOTE if device == "cpu" else CUDA_NOTE,
        "quick": quick,
        "sampler": sampler,
        "results": results,
    }


def prepare(device: str) -> tuple[str, ...]:
    """Set vLLM up for ``device``; returns what was shimmed, as the report
    names it. "cpu": ``CPU_SHIMS``. "cuda": nothing where vLLM is a normal
    install; on vLLM's source alone (no compiled ``vllm._C*``), only what
    needs them (``shims.CUDA_SOURCE_SHIMS``)."""
    from mtpstate.tools.vllm_bench import shims

    if device == "cpu":
        shims.install_cpu_shims()
        return CPU_SHIMS
    return shims.install_source_cuda_shims()


# ----------------------------------------------------------------------------
# the report


def header(doc_or_info: dict, device: str, shims, note: str | None = None) -> list[str]:
    """The lines naming what is measured (``note``: the last line's text;
    default: what a CPU or a CUDA run of the benchmark is)."""
    import mtpstate

    v = doc_or_info
    lines = [
        f"mtpstate {mtpstate.__version__} against vLLM {v['version']} ({v['path']})",
        f"device: {device}; " + ("shimmed:" if shims else "nothing shimmed"),
    ]
    lines += [f"  - {s}" for s in shims]
    lines.append(f"note: {note or (CPU_NOTE if device == 'cpu' else CUDA_NOTE)}")
    return lines


COLUMNS = (
    ("level", 13),
    ("workload", 14),
    ("N", 6),
    ("vLLM us", 10),
    ("mtpstate us", 12),
    ("speedup [p10-p90]", 22),
    ("ops/step off/on", 16),
    ("launches off/on", 16),
)


def table_header() -> str:
    return "".join(f"{name:>{w}}" if i > 1 else f"{name:<{w}}" for i, (name, w) in enumerate(COLUMNS))


def table_row(r: dict) -> str:
    """One result as a row: median us per step on each side, the paired
    median of vLLM / mtpstate with its p10-p90, and (runner) the torch
    operations and device launches per step on each side (steps without new
    requests)."""
    off = r.get("vllm_median_us", r.get("mrv2_median_us"))
    speed = f"{r['paired_median']:.2f}x [{r['paired_p10']:.2f}-{r['paired_p90']:.2f}]"
    ops = launches = "-"
    if "torch_ops" in r:
        o = r["torch_ops"]
        ops = f"{_count(o['vllm'])}/{_count(o['mtpstate'])}"
        key = "cuda_launches" if "cuda_launches" in o["vllm"] else "no_op_launches"
        launches = f"{_count(o['vllm'][key])}/{_count(o['mtpstate'][key])}"
    cells = (r["level"], r["workload"], str(r["n"]), f"{off:.1f}", f"{r['mtpstate_median_us']:.1f}", speed, ops)
    cells += (launches,)
    return "".join(f"{c:>{w}}" if i > 1 else f"{c:<{w}}" for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS)))


def _count(d: dict) -> str:
    v = d["without_new"] if d.get("without_new") is not None else d.get("with_new")
    return "-" if v is None else f"{v:.0f}"


LEGEND = (
    "vLLM us / mtpstate us: median host time per step, vLLM's own code vs mtpstate (bookkeeping: finish/add/update "
    "+ gather_batch_req_state vs RequestTable.apply; runner: execute_model's host part up to the forward, plugin "
    "off vs on). speedup: the median of per-step vLLM/mtpstate ratios (paired, interleaved), p10-p90 its spread; "
    "above 1 mtpstate is faster. ops and launches: per step without new requests, off/on."
)


def plot(doc: dict, path: str) -> None:
    """One panel per level: median us per step against N, both sides, one
    line pair per workload kind (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv for lv in LEVELS if any(r["level"] == lv for r in doc["results"])]
    fig, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4.2), squeeze=False)
    for ax, level in zip(axes[0], levels):
        rs = [r for r in doc["results"] if r["level"] == level]
        for k, kind in enumerate(dict.fromkeys(r["workload"].rsplit("-", 1)[0] for r in rs)):
            sel = sorted((r for r in rs if r["workload"].rsplit("-", 1)[0] == kind), key=lambda r: r["n"])
            ns = [r["n"] for r in sel]
            color = f"C{k}"
            ax.plot(ns, [r.get("vllm_median_us", r.get("mrv2_median_us")) for r in sel], "o--", color=color,
                    label=f"{kind}: vLLM")  # fmt: skip
            ax.plot(ns, [r["mtpstate_median_us"] for r in sel], "o-", color=color, label=f"{kind}: mtpstate")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("running requests (N)")
        ax.set_ylabel("median us per step")
        ax.set_title(level)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    v = doc["vllm"]
    fig.suptitle(f"mtpstate vs vLLM {v['version']} on {doc['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
