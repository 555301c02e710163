"""mtpstate as a vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process (API server, engine core,
workers), before a worker builds its model runner. With
``VLLM_USE_MTPSTATE=1`` it applies the worked patch (``mrv2.patch``) to
Model Runner V2's ``GPUModelRunner`` in memory: the methods the patch
changes are compiled from the patched text of the module that is loaded and
set on the class. With ``VLLM_USE_MTPSTATE=shadow`` it changes none of
vLLM's code paths: the same guard, then mtpstate runs beside vLLM's own
runner and compares every step (:mod:`mtpstate.integrations.vllm.shadow`).
Without the variable it does nothing.

The guard: before anything is changed, the installed vLLM must be a
supported version, every method the patch changes must be the very
definition the patch was written against (a fingerprint of its source) and
still the live one (not replaced by someone else), every vLLM function
whose results mtpstate computes in its place (``COMPUTED``) must be the one
mtpstate was written against, and the patch must apply exactly. On any
mismatch nothing at all is changed: one WARNING names what differs, and
vLLM runs as if mtpstate were absent.

Nothing here imports vLLM at import time. :func:`register` imports no
vLLM either: the runner's module is patched when it is first imported (a
worker imports it lazily; the API server never does).
"""

from __future__ import annotations

import importlib
import importlib.util
import linecache
import logging
import os
import sys
import threading
from dataclasses import dataclass, field

from mtpstate._after_import import AfterImport
from mtpstate.integrations.vllm import _source
from mtpstate.integrations.vllm.releases import RELEASES

__all__ = [
    "COMPUTED",
    "ENV_VAR",
    "SAMPLER_COMPUTED",
    "SUPPORTED",
    "Verdict",
    "apply",
    "check",
    "check_sampler",
    "definitions",
    "drift",
    "enabled",
    "installed_release",
    "mode",
    "nearest_release",
    "register",
]

ENV_VAR = "VLLM_USE_MTPSTATE"
RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"

# per supported release (mtpstate.integrations.vllm.releases: one folder each,
# with its patch): the fingerprint of every definition the patch changes
# (SUPPORTED: Class.method -> fingerprint), of the vLLM functions whose results
# mtpstate computes in their place (COMPUTED: module -> function ->
# fingerprint; a changed one refuses the patch as a changed method does), and
# of the sampler methods mtpstate answers, writes for, or keeps the bodies of
# (SAMPLER_COMPUTED; a changed one leaves the sampler to vLLM alone, the rest
# of the integration still applies). `make test-vllm` checks them against
# each release's source and patch.
SUPPORTED: dict[str, dict[str, str]] = {v: dict(r.runner) for v, r in RELEASES.items()}
COMPUTED: dict[str, dict[str, dict[str, str]]] = {v: dict(r.computed) for v, r in RELEASES.items()}
SAMPLER_COMPUTED: dict[str, dict[str, dict[str, str]]] = {v: dict(r.sampler) for v, r in RELEASES.items()}


def definitions(release: str) -> dict[str, dict[str, str]]:
    """Every vLLM definition the integration changes, computes or relies on
    for ``release`` (one of :data:`SUPPORTED`): module -> ``Class.method``
    or function -> fingerprint."""
    out = {RUNNER_MODULE: dict(SUPPORTED[release])}
    for table in (COMPUTED, SAMPLER_COMPUTED):
        for mod, names in table.get(release, {}).items():
            out.setdefault(mod, {}).update(names)
    return out


def _version_key(version: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in version.split("+")[0].split(".")[:3])


def nearest_release(version: str | None) -> str:
    """The supported release nearest ``version``: the newest supported one
    not newer than it, else the oldest (None: the newest)."""
    ordered = sorted(SUPPORTED, key=_version_key)
    if version is None:
        return ordered[-1]
    older = [r for r in ordered if _version_key(r) <= _version_key(version)]
    return older[-1] if older else ordered[0]


def drift(read_source, release: str) -> dict[str, str]:
    """Each definition of :func:`definitions` (``release``) in the sources
    ``read_source(module) -> text`` gives: ``module:name`` -> ``"ok"``, or
    what differs (:func:`_verdicts`). Imports nothing: it reads source text."""
    out = {}
    for mod, names in definitions(release).items():
        for name, got in _verdicts(read_source, mod, names, release).items():
            out[f"{mod}:{name}"] = got
    return out


def _verdicts(read_source, mod: str, names: dict[str, str], release: str) -> dict[str, str]:
    """Per definition of module ``mod`` (``name`` -> its fingerprint in
    ``release``): ``"ok"``, ``"missing in the source"``, ``"differs from vLLM
    <release>'s (...)"`` or ``"its source cannot be read (...)"``."""
    try:
        found = _source.function_fingerprints(read_source(mod), names)
    except Exception as e:  # noqa: BLE001  (reported per definition, never raised)
        return dict.fromkeys(names, f"its source cannot be read ({type(e).__name__}: {e})")
    out = {}
    for name, want in names.items():
        fp = found[name]
        if fp is None:
            out[name] = "missing in the source"
        elif fp != want:
            out[name] = f"differs from vLLM {release}'s (fingerprint {fp}, expected {want})"
        else:
            out[name] = "ok"
    return out


# vLLM's own logger hierarchy: its handlers and VLLM_LOGGING_LEVEL apply
logger = logging.getLogger("vllm.mtpstate")

_APPLIED = "__mtpstate_patched__"  # marks a method set by apply()
_lock = threading.RLock()


def mode() -> str:
    """What ``VLLM_USE_MTPSTATE`` asks of this process: ``"on"`` (``1``),
    ``"shadow"`` (``shadow``: vLLM runs as without mtpstate, which is
    compared with it every step) or ``"off"`` (anything else, or unset)."""
    value = os.environ.get(ENV_VAR, "0").strip().lower()
    return {"1": "on", "shadow": "shadow"}.get(value, "off")


def enabled() -> bool:
    """Whether ``VLLM_USE_MTPSTATE=1`` is set in this process."""
    return mode() == "on"


@dataclass
class Verdict:
    """The guard's answer for the vLLM in this process.

    ``ok``: the patch can be applied (or already is: ``applied``).
    ``methods``: per changed method, ``"ok"`` or what differs.
    ``computed``: the same for each vLLM function whose results mtpstate
    computes in its place (``module.function``).
    ``problems``: every reason it cannot be applied, one line each.
    """

    vllm_version: str | None = None
    supported_versions: tuple[str, ...] = tuple(SUPPORTED)
    methods: dict[str, str] = field(default_factory=dict)
    computed: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    applied: bool = False
    change: _source.SourceChange | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems


def _patch_text(release: str) -> str:
    """The patch for supported ``release`` (its folder's ``mrv2.patch``)."""
    return RELEASES[release].patch_text()


def installed_release() -> str | None:
    """The supported release (a key of :data:`SUPPORTED`) of the vLLM in this
    environment; None: no vLLM, or one mtpstate does not support."""
    version = _version()
    release = None if version is None else version.split("+")[0]
    return release if release in SUPPORTED else None


def _version() -> str | None:
    try:
        from vllm.version import __version__
    except Exception:  # noqa: BLE001  (no vLLM, or one that fails to import: reported, never raised)
        return None
    return str(__version__)


def check(module=None) -> Verdict:
    """Run the guard without changing anything.

    Parameters
    ----------
    module
        The loaded ``vllm.v1.worker.gpu.model_runner`` module; None: import it.
    """
    v = Verdict(vllm_version=_version())
    if v.vllm_version is None:
        v.problems.append("vLLM is not importable in this environment")
        return v
    release = v.vllm_version.split("+")[0]
    if release not in SUPPORTED:
        v.problems.append(
            f"vLLM {v.vllm_version} is not a supported version (supported: {', '.join(SUPPORTED)}); "
            "upgrade mtpstate, or install a supported vLLM"
        )
        release = nearest_release(release)  # (what differs from it is reported below)
    expected = SUPPORTED[release]
    if module is None:
        try:
            module = importlib.import_module(RUNNER_MODULE)
        except Exception as e:  # noqa: BLE001
            v.problems.append(f"{RUNNER_MODULE} fails to import: {type(e).__name__}: {e}")
            return v
    path = getattr(module, "__file__", None)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, TypeError) as e:
        v.problems.append(f"the source of {RUNNER_MODULE} cannot be read ({e}); the guard needs it")
        return v
    if ENV_VAR in text:
        v.problems.append(
            f"{path} already carries mtpstate's patch (mrv2.patch): there {ENV_VAR}=1 works without the plugin"
        )
        return v
    try:
        found = _source.fingerprints(text, [tuple(k.split(".", 1)) for k in expected])
    except SyntaxError as e:
        v.problems.append(f"the source of {RUNNER_MODULE} does not parse: {e}")
        return v
    for (cls_name, name), fp in sorted(found.items()):
        key = f"{cls_name}.{name}"
        live = vars(getattr(module, cls_name, None) or object).get(name)
        if live is not None and getattr(live, _APPLIED, False):
            v.applied = True
            v.methods[key] = "ok (mtpstate applied)"
        elif fp is None:
            v.methods[key] = "missing in the source"
        elif fp != expected[key]:
            v.methods[key] = f"differs from vLLM {release}'s (fingerprint {fp}, expected {expected[key]})"
        elif not _defined_in(live, path):
            v.methods[key] = "replaced at run time by other code (not the definition in the source file)"
        else:
            v.methods[key] = "ok"
    if not v.applied:
        diff = _source.split_diff(_patch_text(release))
        try:
            v.change = _source.plan(RUNNER_MODULE, text, diff["vllm/v1/worker/gpu/model_runner.py"])
        except (_source.DiffError, SyntaxError) as e:
            v.problems.append(f"the patch does not apply to {path}: {e}")
        else:
            changed = {f"{c}.{m}" for c, m in v.change.originals}
            if changed != set(expected):
                v.problems.append(f"the patch changes {sorted(changed)}, the guard knows {sorted(expected)}")
    for mod, names in COMPUTED.get(release, {}).items():
        _check_computed(v, release, mod, names)
    bad = {k: m for k, m in (*v.methods.items(), *v.computed.items()) if not m.startswith("ok")}
    for k, m in bad.items():
        v.problems.append(f"{k}: {m}")
    if v.applied and bad:
        v.problems.append("partly applied by another copy of mtpstate")
    return v


def _module_source(name: str) -> str:
    """The source text of vLLM module ``name`` (imported if it is not yet)."""
    module = sys.modules.get(name) or importlib.import_module(name)
    with open(module.__file__, encoding="utf-8") as f:
        return f.read()


def _check_computed(v: Verdict, release: str, mod: str, names: dict[str, str]) -> None:
    short = mod.rsplit(".", 1)[-1]
    for name, got in _verdicts(_module_source, mod, names, release).items():
        if got.startswith("differs"):
            got += "; mtpstate computes its results"
        v.computed[f"{short}.{name}"] = got


_sampler_verdict: dict[str, str] | None = None


def check_sampler(refresh: bool = False) -> dict[str, str]:
    """The guard for the sampler methods mtpstate answers
    (:data:`SAMPLER_COMPUTED`): ``module.Class.method`` -> ``"ok"`` or what
    differs. Computed once per process (``refresh``: again)."""
    global _sampler_verdict
    with _lock:
        if _sampler_verdict is None or refresh:
            v = Verdict(vllm_version=_version())
            if v.vllm_version is not None:
                release = v.vllm_version.split("+")[0]
                table = SAMPLER_COMPUTED.get(release)
                if table is None:
                    v.computed["sampler"] = f"vLLM {v.vllm_version} is not a supported version"
                else:
                    for mod, names in table.items():
                        _check_computed(v, release, mod, names)
            else:
                v.computed["sampler"] = "vLLM is not importable in this environment"
            _sampler_verdict = v.computed
        return dict(_sampler_verdict)


def sampler_methods_ok() -> bool:
    """Whether every sampler method mtpstate answers is vLLM's as it was
    written against (:func:`check_sampler`); logs one INFO line if not."""
    bad = {k: m for k, m in check_sampler().items() if m != "ok"}
    if bad and not getattr(sampler_methods_ok, "_said", False):
        sampler_methods_ok._said = True
        logger.info(
            "mtpstate: vLLM's sampler answers its own per-step questions: %s",
            "; ".join(f"{k}: {m}" for k, m in bad.items()),
        )
    return not bad


def _defined_in(fn, path: str) -> bool:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    return code is not None and os.path.realpath(code.co_filename) == os.path.realpath(path)


def apply(module=None) -> Verdict:
    """Check, then apply the patch to the loaded runner module: all of it or
    nothing. Idempotent: a second call changes nothing more. Logs one
    WARNING when the guard refuses."""
    with _lock:
        if module is None:
            module = importlib.import_module(RUNNER_MODULE)
        v = check(module)
        if v.applied and v.ok:
            return v
        if not v.ok:
            _say_refused(v, "1", "the integration is not applied")
            return v
        change = v.change
        # everything compiled before anything is set: never half-applied
        new = compile_patched(module, change, module.__dict__)
        for (cls_name, name), fn in new.items():
            setattr(fn, _APPLIED, True)
            fn.__mtpstate_original__ = vars(getattr(module, cls_name))[name]
        for stmt in change.imports:
            exec(stmt, module.__dict__)  # noqa: S102  (a new import statement of the patch)
        for (cls_name, name), value in change.class_attrs.items():
            setattr(getattr(module, cls_name), name, value)
        for (cls_name, name), fn in new.items():
            setattr(getattr(module, cls_name), name, fn)
        v.applied = True
        logger.debug("mtpstate: applied to %s (%d methods)", RUNNER_MODULE, len(new))
        return v


def _say_refused(v: Verdict, value: str, what: str) -> None:
    """The guard's one WARNING: ``VLLM_USE_MTPSTATE=value``, but ``what``."""
    logger.warning(
        "mtpstate: %s=%s, but %s; vLLM runs without it. %s. Run `mtpstate vllm-check` for the details.",
        ENV_VAR,
        value,
        what,
        "; ".join(v.problems),
    )


def compile_patched(module, change: _source.SourceChange, module_globals: dict) -> dict:
    """The methods the patch changes, compiled from the patched text of
    ``module`` with ``module_globals`` (``(class, method)`` -> function);
    tracebacks show the patched lines. Sets nothing on the module."""
    filename = f"<mtpstate: {module.__file__} + mrv2.patch>"
    lines = change.patched_text.splitlines(keepends=True)
    linecache.cache[filename] = (len(change.patched_text), None, lines, filename)
    return {key: _source.compile_method(change, key, module_globals, filename) for key in change.methods}


def shadow(module=None) -> Verdict:
    """Check, then set up shadow mode on the loaded runner module
    (:func:`mtpstate.integrations.vllm.shadow.install`): vLLM's methods stay
    vLLM's, observed by wrappers; the patched methods run only on the
    shadow's own runner. Logs one WARNING when the guard refuses."""
    from mtpstate.integrations.vllm import shadow as _shadow

    with _lock:
        if module is None:
            module = importlib.import_module(RUNNER_MODULE)
        v = check(module)
        if not v.ok:
            _say_refused(v, "shadow", "the shadow is not set up")
            return v
        if v.applied:
            logger.warning("mtpstate: %s=shadow, but mtpstate is applied in this process; no shadow", ENV_VAR)
            return v
        # the patched methods compiled against a copy of the module's
        # globals (with the patch's imports): vLLM's module is not touched
        scope = dict(module.__dict__)
        for stmt in v.change.imports:
            exec(stmt, scope)  # noqa: S102  (a new import statement of the patch)
        _shadow.install(module, compile_patched(module, v.change, scope))
        return v


class _PatchOnImport(AfterImport):
    """Applies the patch right after ``vllm.v1.worker.gpu.model_runner`` is
    executed (workers import it lazily, after the plugins are loaded)."""

    def __init__(self):
        super().__init__(RUNNER_MODULE, _apply_safely)


def _apply_safely(module) -> None:
    try:
        if mode() == "shadow":
            shadow(module)
        else:
            apply(module)
    except Exception:  # noqa: BLE001  (a bug of ours must not stop vLLM: it runs without mtpstate)
        logger.exception("mtpstate: failed while applying the integration; vLLM runs without it")


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Without
    ``VLLM_USE_MTPSTATE=1`` or ``=shadow``: nothing. With it: patch the
    runner module (or set up the shadow) now if it is loaded, else when it
    is first imported. Safe to call any number of times."""
    if mode() == "off":
        logger.debug("mtpstate: %s is neither 1 nor shadow; the vLLM plugin does nothing", ENV_VAR)
        return
    with _lock:
        module = sys.modules.get(RUNNER_MODULE)
        if module is not None:
            _apply_safely(module)
        elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())


RUNNER_CHOICE_VAR = "VLLM_USE_V2_MODEL_RUNNER"


def _is_zero(value: str | None) -> bool:
    # vLLM reads the variable as bool(int(value))
    try:
        return value is not None and int(value) == 0
    except ValueError:
        return False


def report() -> dict:
    """The operator's check (``mtpstate vllm-check``): every fact that decides
    whether ``VLLM_USE_MTPSTATE=1`` would turn mtpstate on in this
    environment. Changes nothing. ``would_apply`` is the answer."""
    from importlib.metadata import entry_points

    import mtpstate

    facts: dict = {"mtpstate": mtpstate.__version__, "vllm": None, "supported_versions": list(SUPPORTED)}
    if importlib.util.find_spec("vllm") is None:
        facts.update(would_apply=False, reasons=["vLLM is not installed in this environment"])
        return facts
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value == f"{__name__}:register"]
    facts["entry_point"] = f"{eps[0].name} = {eps[0].value}" if eps else None
    allowed = os.environ.get("VLLM_PLUGINS")
    names = None if allowed is None else [n.strip() for n in allowed.split(",")]
    facts["vllm_plugins_filter"] = allowed
    facts[ENV_VAR] = os.environ.get(ENV_VAR)
    v = check()
    facts.update(
        vllm=v.vllm_version, supported=v.vllm_version is not None and v.vllm_version.split("+")[0] in SUPPORTED
    )
    facts["methods"] = v.methods
    facts["computed"] = v.computed
    facts["sampler"] = check_sampler(refresh=True)
    if not facts["supported"] and v.vllm_version is not None:
        # the next release is a known step: what differs from the nearest supported one
        near = facts["nearest_supported"] = nearest_release(v.vllm_version)
        facts["drift"] = {k: m for k, m in drift(_module_source, near).items() if m != "ok"}
    reasons = list(v.problems)
    if not eps:
        reasons.append("mtpstate's entry point is not visible to vLLM (install mtpstate into vLLM's environment)")
    elif names is not None and eps[0].name not in names:
        reasons.append(f"VLLM_PLUGINS={allowed!r} leaves out {eps[0].name!r}")
    # releases that still have Model Runner V1 (0.32, 0.33) run it when asked
    runner_choice = facts[RUNNER_CHOICE_VAR] = os.environ.get(RUNNER_CHOICE_VAR)
    if _is_zero(runner_choice):
        reasons.append(
            f"{RUNNER_CHOICE_VAR}={runner_choice} asks vLLM for Model Runner V1, which mtpstate leaves alone "
            "(it changes Model Runner V2 only)"
        )
    facts["would_apply"] = not reasons
    facts["reasons"] = reasons
    # shadow mode: the same guard and entry point; its settings as this environment sets them
    from mtpstate.integrations.vllm import shadow as _shadow

    facts["shadow"] = {
        "would_set_up": not reasons,
        "every": _shadow.setting(_shadow.EVERY_VAR, _shadow.DEFAULT_EVERY),
        "log_every": _shadow.setting(_shadow.LOG_EVERY_VAR, _shadow.DEFAULT_LOG_EVERY),
    }
    facts["mode"] = mode()
    return facts
