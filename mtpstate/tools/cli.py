"""Command line: ``mtpstate sim | replay | bench | bench-vllm | warmup | vllm-check`` (also ``python -m mtpstate``).

Every user error is one line on stderr that names the flag or file, with exit
status 2 (usage: checked before any work starts) or 1 (runtime); ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

EXIT_RUNTIME = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status ``status``."""

    def __init__(self, message: str, status: int = EXIT_RUNTIME):
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's default in its help."""

    def _get_help_string(self, action):
        h = action.help or ""
        quiet = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if not quiet and "%(default)" not in h:
            h += " (default: %(default)s)"
        return h


# ----------------------------------------------------------------------------
# argument types: each rejects bad values with a message argparse prefixes
# with the flag ("argument --sizes: ...")


def _int(lo: int | None = None, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
        return v

    return parse


def _float(lo: float, hi: float | None = None):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not (v >= lo and (hi is None or v <= hi)):  # also rejects nan
            want = f">= {lo:g}" if hi is None else f"in [{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"must be {want}, got {s}")
        return v

    return parse


def _ints(lo: int, count: int | None = None, ordered: bool = False, hi: int | None = None):
    """Comma-separated integers >= lo (exactly ``count`` of them; ascending if
    ``ordered``)."""
    one = _int(lo, hi)

    def parse(s: str) -> tuple[int, ...]:
        parts = [p.strip() for p in s.split(",")]
        if not s.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
        try:
            vals = tuple(one(p) for p in parts)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} in {s!r}" if len(parts) > 1 else str(e)) from None
        if count is not None and len(vals) != count:
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated integers (low,high), got {s!r}")
        if ordered and list(vals) != sorted(vals):
            raise argparse.ArgumentTypeError(f"low must be <= high, got {s!r}")
        return vals

    return parse


# ----------------------------------------------------------------------------
# checks done before a run starts


def _check_output(path: str | None, flag: str) -> None:
    """An output file must be creatable: not a directory, in an existing,
    writable directory."""
    if path is None:
        return
    if os.path.isdir(path):
        raise CliError(f"{flag} {path!r} is a directory, expected a file path", EXIT_USAGE)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CliError(f"{flag} {path!r}: directory {parent!r} does not exist", EXIT_USAGE)
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(f"{flag} {path!r}: not writable", EXIT_USAGE)


def _check_plot_deps(path: str | None) -> None:
    if path is not None and importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib, which is not installed: pip install 'mtpstate[plot]'")


def _check_input(path: str) -> None:
    if not os.path.exists(path):
        raise CliError(f"trace file {path!r}: no such file")
    if os.path.isdir(path):
        raise CliError(f"trace file {path!r} is a directory")
    if not os.access(path, os.R_OK):
        raise CliError(f"trace file {path!r}: not readable")


def _wrote(path: str, what: str = "") -> None:
    print(f"wrote {path}" + (f": {what}" if what else ""))


class _Bar:
    """A progress bar on stderr, drawn only on a terminal (no ``\\r`` frames
    in pipes and CI logs)."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, max(total, 1)
        self.on = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if not self.on or (done != self.total and done % max(1, self.total // 100)):
            return
        fill = 30 * done // self.total
        print(f"\r  {self.label} [{'#' * fill}{'.' * (30 - fill)}] {done}/{self.total}", end="", file=sys.stderr)
        if done >= self.total:
            print(file=sys.stderr)
        sys.stderr.flush()


# ----------------------------------------------------------------------------
# the parser


def _sim_defaults():
    from mtpstate.tools.sim import SimConfig

    return SimConfig()


SIM_HELP = """\
Simulate an MTP-speculating scheduler and record its steps to a trace file.

The defaults below are a busier workload than SimConfig()'s (MTP drafts,
preemptions, aborts, prefix hits and remote KV switched on), so that a trace
exercises every kind of step.

example:
  mtpstate sim --steps 500 --seed 1 --num-spec 3 --accept 0.7 --out run.trace"""

REPLAY_HELP = """\
Replay a trace through the implementations; time each step and measure how
far each one's num_computed_tokens drifts from the scheduler's.

example:
  mtpstate replay run.trace --impl all --json replay.json --plot drift.png"""

BENCH_HELP = """\
RequestTable and RequestIndex against the per-request loop and the dict, on
identical steps in one run (paired, interleaved). The default run (N = 1,
256, 1024, 4096) takes about 2 minutes on 2 cores, --full (N = 1 .. 16384)
several more, --quick about 20 s.

examples:
  mtpstate bench --quick
  mtpstate bench --only vllm --sizes 1,1024,4096 --json out.json --plot out.png
  mtpstate bench --only device --json device.json   # the device mirror (N = 1,16,256,1024,4096)"""

BENCH_VLLM_HELP = """\
Measure mtpstate on the vLLM installed here: that vLLM's own Scheduler /
AsyncScheduler drives the embedded workloads (steady decode; busy, with
arrivals and finishes every step; chunked prefill), MTP k = 3, and each step
is timed paired and interleaved at two levels: the bookkeeping (vLLM's
finish/add/update + gather_batch_req_state vs RequestTable.apply) and the
runner's host step up to the forward (mtpstate's plugin on vs off). On
--device cpu, vLLM's device launches are counted no-ops (the header lists the
shims); on --device cuda nothing is shimmed (on vLLM's source without its
compiled ops, only what needs them: the header says which). Downloads nothing. The default
run (N = 1,16,256,1024,4096, both levels) takes 15-25 minutes on 2 cores;
--quick (N = 16, 20 steps) under a minute.

examples:
  mtpstate bench-vllm --quick
  mtpstate bench-vllm --device cuda --sizes 1,256,4096 --json gpu.json
  mtpstate bench-vllm --workload chunked --level runner --plot chunked.png"""

WARMUP_HELP = """\
Compile mtpstate's kernels now (or load them from numba's on-disk cache), so
that no compilation lands on a serving process's first step. Run it in an
installer or a container build, with the same NUMBA_CACHE_DIR the server uses.

example:
  NUMBA_CACHE_DIR=/opt/numba-cache mtpstate warmup"""


VLLM_CHECK_HELP = """\
Run in vLLM's environment: does VLLM_USE_MTPSTATE=1 turn mtpstate on there?
One line per fact: vLLM's version and whether it is supported, whether vLLM
can see mtpstate's plugin, the guard's verdict on every method the
integration changes, and what VLLM_USE_MTPSTATE=1 would do. Changes nothing.
Exit status 0 only when the integration would apply, 1 otherwise.

examples:
  mtpstate vllm-check
  mtpstate vllm-check --json"""

VLLM_VERIFY_HELP = """\
Run in vLLM's environment, before turning mtpstate on: does it agree with
vLLM here, on this vLLM, torch, numba and device? Drives the installed
vLLM's own Scheduler / AsyncScheduler (a tiny model config, nothing
downloaded) through two runners, step by step: vLLM's own methods, and the
same methods with mtpstate applied by its plugin, both with vLLM's real
Sampler and a mix of sampling params, over the workloads (steady and busy
batches, chunked prefill, MTP k = 1-4, preemption, async scheduling, prefix
caching). After every step it compares, per request id, every state array
(host, and device tensors copied back after a synchronize), the batch,
every field of prepare_inputs' InputBatch, and every sampler value and
answer. One line per workload, the first disagreement in full, then one
verdict line. Exit status 0 only with 0 disagreements.

--device cuda runs both runners on the GPU with nothing shimmed (vLLM's
kernels run, and what they write is compared too); --device cpu (the
default) shims vLLM's device launches on both sides. --sabotage NAME
injects a known mutant of mtpstate, to see the check fail here: NAME is one
of %s.

examples:
  mtpstate vllm-verify --quick
  mtpstate vllm-verify --device cuda --json verify.json
  mtpstate vllm-verify --quick --sabotage tokens"""


def build_parser() -> argparse.ArgumentParser:
    from mtpstate.tools.bench import version_string

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    # before the command too; its own dest, or the command's default would reset it
    top = argparse.ArgumentParser(add_help=False)
    top.add_argument("--debug", dest="debug_top", action="store_true", help="show the traceback of an error")

    p = _Parser(
        prog="mtpstate",
        description="Batched request state for LLM serving engines: tools for perf engineers.",
        epilog="examples:\n  mtpstate bench --quick\n  mtpstate sim --steps 500 --out run.trace\n"
        "  mtpstate replay run.trace\n  mtpstate warmup\n  mtpstate vllm-check\n  mtpstate vllm-verify --quick\n"
        "  mtpstate bench-vllm --quick",
        formatter_class=_Formatter,
        parents=[top],
    )
    p.add_argument("--version", action="version", version=f"mtpstate {version_string()}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=description, formatter_class=_Formatter, parents=[common])

    d = _sim_defaults()
    s = command("sim", "simulate a scheduler and record a trace", SIM_HELP)
    s.add_argument("--steps", type=_int(1), required=True, help="scheduler steps to simulate")
    s.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    s.add_argument("--seed", type=_int(0), default=d.seed, help="random seed")
    s.add_argument("--num-spec", type=_int(0, 64), default=2, help="MTP draft tokens per decode step")
    s.add_argument("--accept", type=_float(0.0, 1.0), default=d.accept, help="per-draft acceptance probability")
    s.add_argument("--max-num-reqs", type=_int(1), default=d.max_num_reqs, help="most requests running at once")
    s.add_argument("--max-model-len", type=_int(8), default=d.max_model_len, help="prompt + output tokens, at most")
    s.add_argument(
        "--max-num-batched-tokens", type=_int(1), default=d.max_num_batched_tokens, help="token budget per step"
    )
    s.add_argument(
        "--block-sizes",
        type=_ints(1),
        default=",".join(map(str, d.block_sizes)),
        metavar="B[,B...]",
        help="tokens per KV-cache block, one per KV-cache group",
    )
    s.add_argument("--arrivals", type=_float(0.0), default=d.arrivals_per_step, help="mean new requests per step")
    for flag, rng in (("--prompt-len", d.prompt_len), ("--output-len", d.output_len)):
        s.add_argument(
            flag, type=_ints(1, 2, True), default=f"{rng[0]},{rng[1]}", metavar="LOW,HIGH", help="length range, tokens"
        )
    prob = _float(0.0, 1.0)
    s.add_argument("--preempt", type=prob, default=0.05, help="per step: probability of preempting a request")
    s.add_argument("--abort", type=prob, default=0.02, help="per step: probability of aborting a running request")
    s.add_argument(
        "--abort-waiting", type=prob, default=0.02, help="per step: probability of aborting a never-scheduled request"
    )
    s.add_argument("--prefix-hit", type=prob, default=0.1, help="probability that a new request hits the prefix cache")
    s.add_argument("--remote-kv", type=prob, default=0.05, help="probability that a new request brings remote KV")
    s.add_argument(
        "--resume-mode",
        choices=["new", "cached"],
        default=d.resume_mode,
        help="how a preempted request comes back: re-sent as new (Model Runner V2) or listed in resumed_req_ids",
    )

    r = command("replay", "replay a trace; time per step and drift from the scheduler", REPLAY_HELP)
    r.add_argument("file", help="trace file written by `mtpstate sim`")
    r.add_argument(
        "--impl", choices=["vectorized", "loop", "legacy", "all"], default="all", help="implementation(s) to replay"
    )
    r.add_argument("--json", metavar="FILE", help="write the results as JSON")
    r.add_argument("--plot", metavar="FILE.png", help="plot drift per step (needs matplotlib)")

    b = command("bench", "RequestTable / RequestIndex against the loop / dict, in one run", BENCH_HELP)
    b.add_argument("--quick", action="store_true", help="fewer sizes, steps and repeats")
    b.add_argument("--full", action="store_true", help="the full sweep: N = 1,16,64,256,1024,4096,16384")
    b.add_argument(
        "--sizes",
        type=_ints(1, hi=65536),
        metavar="N[,N...]",
        help="running requests per step (default: 1,256,1024,4096; --full 1,16,64,256,1024,4096,16384; "
        "--quick 1,256,4096)",
    )
    b.add_argument(
        "--only",
        choices=["table", "vllm", "index", "device"],
        help="run one part (default: table, vllm, index; device: the device mirror's cost, what `make gpu-check` runs)",
    )
    b.add_argument(
        "--vllm-src",
        metavar="DIR",
        help="with --only device on CUDA: an unpacked vLLM sdist whose StagedWriteTensor is the vLLM-way upload",
    )
    b.add_argument("--json", metavar="FILE", help="write results and run metadata as JSON")
    b.add_argument("--plot", metavar="FILE.png", help="write a plot, one panel per workload (needs matplotlib)")

    v = command("bench-vllm", "mtpstate vs the vLLM installed here, on its own scheduler steps", BENCH_VLLM_HELP)
    v.add_argument("--quick", action="store_true", help="one size (N = 16), 20 steps per workload, 2 repeats")
    v.add_argument(
        "--sizes", type=_ints(1, hi=16384), metavar="N[,N...]", help="running requests (default: 1,16,256,1024,4096)"
    )
    v.add_argument(
        "--workload",
        choices=["steady", "busy", "chunked"],
        action="append",
        help="a workload kind; repeat for several (default: all three)",
    )
    v.add_argument("--level", choices=["bookkeeping", "runner", "both"], default="both", help="what is timed")
    v.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: nothing shimmed, run on the GPU")
    v.add_argument("--repeats", type=_int(1, 100), help="passes over the recorded steps (default: 5; --quick 2)")
    v.add_argument(
        "--no-sampler",
        action="store_true",
        help="runner level: without vLLM's Sampler on either side (default: attached, its questions timed)",
    )
    v.add_argument("--json", metavar="FILE", help="write results and run metadata as JSON")
    v.add_argument("--plot", metavar="FILE.png", help="plot us per step against N, one panel per level (matplotlib)")

    command("warmup", "compile the kernels now (ahead of a server's first step)", WARMUP_HELP)

    c = command("vllm-check", "would VLLM_USE_MTPSTATE=1 turn mtpstate on in this vLLM?", VLLM_CHECK_HELP)
    c.add_argument("--json", action="store_true", help="the facts as one JSON object on stdout")

    from mtpstate.tools.vllm_verify.sabotage import MUTANTS

    workload_names = _verify_workload_names()
    f = command(
        "vllm-verify",
        "does mtpstate agree with vLLM's own runner here? (the runner differential)",
        VLLM_VERIFY_HELP % ", ".join(MUTANTS),
    )
    f.add_argument(
        "--quick", action="store_true", help="each workload for its own steps, not 4x as many (about a minute)"
    )
    f.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: both runners on the GPU")
    f.add_argument(
        "--workload", choices=workload_names, action="append", help="one workload; repeat for several (default: all)"
    )
    f.add_argument("--steps", type=_int(1), help="each workload's steps, at most")
    f.add_argument("--sabotage", choices=list(MUTANTS), metavar="NAME", help="inject a known mutant (must fail)")
    f.add_argument("--json", metavar="FILE", help="write the report as JSON")
    return p


def _verify_workload_names() -> list[str]:
    from mtpstate.tools.vllm_bench.workloads import WORKLOADS

    return sorted(WORKLOADS)


# ----------------------------------------------------------------------------
# commands


def _cmd_sim(args) -> None:
    from mtpstate.tools.sim import SimConfig
    from mtpstate.tools.trace import record

    room = args.max_model_len - args.num_spec - 2
    if args.prompt_len[1] > room:  # a usage error only visible with two flags together
        raise CliError(
            f"argument --prompt-len: high {args.prompt_len[1]} leaves no room to decode within --max-model-len "
            f"{args.max_model_len} (at most {room} with --num-spec {args.num_spec}) (see `mtpstate sim --help`)",
            EXIT_USAGE,
        )
    _check_output(args.out, "--out")
    cfg = SimConfig(
        max_num_reqs=args.max_num_reqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_sizes=args.block_sizes,
        arrivals_per_step=args.arrivals,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        num_spec=args.num_spec,
        accept=args.accept,
        preempt_prob=args.preempt,
        abort_prob=args.abort,
        abort_waiting_prob=args.abort_waiting,
        prefix_hit_prob=args.prefix_hit,
        remote_kv_prob=args.remote_kv,
        resume_mode=args.resume_mode,
        seed=args.seed,
    )
    bar = _Bar("sim", args.steps)
    tr = record(cfg, args.steps, args.out, progress=lambda i, n: bar(i))
    n_req = len({x for so in tr.steps for x in so.num_scheduled_tokens})
    _wrote(args.out, f"{len(tr)} steps, {n_req} requests")


def _cmd_replay(args) -> None:
    from mtpstate.tools.replay import IMPLS, plot_drift, replay
    from mtpstate.tools.trace import TraceError, load

    _check_input(args.file)
    _check_output(args.json, "--json")
    _check_output(args.plot, "--plot")
    _check_plot_deps(args.plot)
    try:
        tr = load(args.file)
    except TraceError as e:  # its message names the file
        raise CliError(str(e)) from e
    impls = IMPLS if args.impl == "all" else (args.impl,)
    bars: dict = {}

    def progress(impl, i, n):
        bars.setdefault(impl, _Bar(f"{impl:<10}", n))(i)

    res = replay(tr, impls, progress=progress)
    print(f"{'impl':<12}{'us/step (mean)':>16}{'median':>10}{'max drift':>11}")
    for impl, x in res["impls"].items():
        print(f"{impl:<12}{x['us_per_step']:>16.1f}{x['median_us_per_step']:>10.1f}{x['max_drift']:>11}")
    if res["agree"] is not None:
        print("loop and vectorized agree on every step" if res["agree"] else "loop and vectorized DISAGREE")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
        _wrote(args.json)
    if args.plot:
        plot_drift(res, args.plot, title=f"drift from the scheduler: {args.file}")
        _wrote(args.plot)


def _cmd_bench(args) -> None:
    from mtpstate.tools.bench import run

    _check_output(args.json, "--json")
    _check_output(args.plot, "--plot")
    _check_plot_deps(args.plot)
    what = (args.only,) if args.only else ("table", "vllm", "index")
    if args.quick and args.full:
        raise CliError("--quick and --full exclude each other")
    if args.vllm_src is not None and args.only != "device":
        raise CliError("--vllm-src goes with --only device")
    if args.vllm_src is not None and not os.path.isfile(
        os.path.join(args.vllm_src, "vllm", "v1", "worker", "gpu", "buffer_utils.py")
    ):
        raise CliError(
            f"--vllm-src {args.vllm_src}: not an unpacked vLLM source tree (no vllm/v1/worker/gpu/buffer_utils.py)"
        )
    if args.only == "device":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise CliError("--only device needs torch: pip install 'mtpstate[torch]'") from None
    run(
        quick=args.quick,
        sizes=args.sizes,
        full=args.full,
        json_path=args.json,
        plot_path=args.plot,
        what=what,
        wrote=_wrote,
        vllm_src=args.vllm_src,
    )


def _vllm_set_up(device: str):
    """The installed vLLM checked and set up for ``device`` (a usage error
    if it cannot run there): ``(what was found, what was shimmed)``."""
    import logging

    from mtpstate.tools import bench_vllm

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM's first import: its start-up lines
    try:
        found = bench_vllm.check_environment(device)
    except bench_vllm.UnusableEnvironment as e:
        raise CliError(str(e), EXIT_USAGE) from None
    logging.getLogger("vllm").setLevel(logging.ERROR)  # the scheduler's start-up lines are not the report
    return found, bench_vllm.prepare(device)


def _cmd_bench_vllm(args) -> None:
    from mtpstate.tools import bench_vllm

    _check_output(args.json, "--json")
    _check_output(args.plot, "--plot")
    _check_plot_deps(args.plot)
    found, shims = _vllm_set_up(args.device)
    for line in bench_vllm.header(found, args.device, shims):
        print(line)
    print(bench_vllm.table_header(), flush=True)
    levels = bench_vllm.LEVELS if args.level == "both" else (args.level,)
    doc = bench_vllm.run(
        found,
        device=args.device,
        kinds=tuple(dict.fromkeys(args.workload)) if args.workload else None,
        sizes=args.sizes,
        levels=levels,
        repeats=args.repeats,
        quick=args.quick,
        sampler=not args.no_sampler,
        shims=shims,
        on_result=lambda r: print(bench_vllm.table_row(r), flush=True),
    )
    print(bench_vllm.LEGEND)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        _wrote(args.json)
    if args.plot:
        bench_vllm.plot(doc, args.plot)
        _wrote(args.plot)


def _cmd_warmup(args) -> None:
    import mtpstate
    from mtpstate._kernels.jit import COMPILE_NOTICE

    t = mtpstate.warmup()
    how = "compiled now" if COMPILE_NOTICE.total_s > 0 else "loaded from numba's on-disk cache"
    where = os.environ.get("NUMBA_CACHE_DIR") or "numba's default (__pycache__ next to mtpstate's modules)"
    print(f"mtpstate kernels ready in {t:.1f} s ({how}); cache: {where}")


def _cmd_vllm_check(args) -> int:
    import logging

    from mtpstate.integrations.vllm import plugin

    logging.getLogger("vllm").setLevel(logging.ERROR)  # importing vLLM's runner may log; the facts are ours
    f = plugin.report()
    if args.json:
        print(json.dumps(f, indent=1))
    else:
        print(f"mtpstate: {f['mtpstate']}")
        if f["vllm"] is None and "methods" not in f:
            print("vLLM: not installed")
        else:
            ok = "supported" if f["supported"] else f"not supported (supported: {', '.join(f['supported_versions'])})"
            print(f"vLLM: {f['vllm']}, {ok}")
            print(f"entry point (vllm.general_plugins): {f['entry_point'] or 'not visible'}")
            if f["vllm_plugins_filter"] is not None:
                print(f"VLLM_PLUGINS: {f['vllm_plugins_filter']!r}")
            for name, verdict in f["methods"].items():
                print(f"guard: {name}: {verdict}")
            for name, verdict in f.get("computed", {}).items():
                print(f"guard (computed by mtpstate): {name}: {verdict}")
            for name, verdict in f.get("sampler", {}).items():
                print(f"guard (sampler, answered by mtpstate): {name}: {verdict}")
            if "nearest_supported" in f:
                print(
                    f"nearest supported release: vLLM {f['nearest_supported']}; its definitions that differ here: "
                    f"{len(f['drift'])}"
                )
                for name, verdict in f["drift"].items():
                    print(f"drift from {f['nearest_supported']}: {name}: {verdict}")
            print(f"{plugin.ENV_VAR} now: {f[plugin.ENV_VAR] or 'unset'}")
            if f.get(plugin.RUNNER_CHOICE_VAR) is not None:
                print(f"{plugin.RUNNER_CHOICE_VAR} now: {f[plugin.RUNNER_CHOICE_VAR]}")
        if f["would_apply"]:
            print(
                f"{plugin.ENV_VAR}=1 would: apply mtpstate to Model Runner V2's GPUModelRunner in every vLLM "
                "process (pooling, PCP, adaptive-verification and encoder-decoder runners keep vLLM's own path)"
            )
            sh = f.get("shadow", {})
            print(
                f"{plugin.ENV_VAR}=shadow would: leave vLLM's runner as it is and keep mtpstate's state beside "
                "it, compared by request id after every step (state, batch, inputs, sampler values and answers), "
                f"device tensors every {sh.get('every')} batches (MTPSTATE_SHADOW_EVERY), one INFO line every "
                f"{sh.get('log_every')} steps (MTPSTATE_SHADOW_LOG_EVERY); the first disagreement: one WARNING "
                "in full, then the shadow stops. Never changes what vLLM does"
            )
        else:
            for r in f["reasons"]:
                print(f"{plugin.ENV_VAR}=1 would do nothing: {r}")
                print(f"{plugin.ENV_VAR}=shadow would do nothing: {r}")
    return 0 if f["would_apply"] else EXIT_RUNTIME


def _cmd_vllm_verify(args) -> int:
    from mtpstate.tools.vllm_verify.verify import header as verify_header
    from mtpstate.tools.vllm_verify.verify import shimmed, verify

    _check_output(args.json, "--json")
    found, shims = _vllm_set_up(args.device)
    for line in verify_header(found, args.device, shims):
        print(line)
    if args.sabotage:
        from mtpstate.tools.vllm_verify.sabotage import MUTANTS

        print(f"mutant injected: {args.sabotage} ({MUTANTS[args.sabotage]}): the check must fail")
    doc = verify(
        device=args.device,
        quick=args.quick,
        names=args.workload,
        steps=args.steps,
        sabotage=args.sabotage,
        say=lambda line: print(line, flush=True),
    )
    doc["shims"] = list(shimmed(args.device, shims))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        _wrote(args.json)
    return 0 if doc["passed"] else EXIT_RUNTIME


COMMANDS = {
    "sim": _cmd_sim,
    "replay": _cmd_replay,
    "bench": _cmd_bench,
    "bench-vllm": _cmd_bench_vllm,
    "warmup": _cmd_warmup,
    "vllm-check": _cmd_vllm_check,
    "vllm-verify": _cmd_vllm_verify,
}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.error(f"missing a command, one of: {', '.join(COMMANDS)}")
    prog = f"mtpstate {args.cmd}"
    args.debug = args.debug or args.debug_top
    try:
        status = COMMANDS[args.cmd](args)
    except CliError as e:
        if args.debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an unexpected failure: still one line unless --debug
        if args.debug:
            raise
        print(f"{prog}: error: {type(e).__name__}: {e} (run again with --debug for the traceback)", file=sys.stderr)
        return EXIT_RUNTIME
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
