"""Shadow mode (``VLLM_USE_MTPSTATE=shadow``): mtpstate beside vLLM's own
runner in a live server, compared every step, changing nothing of vLLM's.

vLLM's ``GPUModelRunner`` keeps its own methods; four of them are observed
by wrappers that call the original first (``add_requests`` only notes
numpy's RNG state before it):

- ``initialize_kv_cache``: the runner's shadow is built
  (:class:`~.monitor.Shadow`: its own request state, block tables, input
  buffers and sampler, kept by mtpstate as ``VLLM_USE_MTPSTATE=1`` keeps a
  runner);
- ``update_requests``: the step is applied to the shadow; the host state and
  the new requests' sampler values are compared by request id;
- ``prepare_inputs``: the batch, the input arrays and the sampler's answers
  are compared; every ``MTPSTATE_SHADOW_EVERY`` batches (default 16) also
  the device tensors, on vLLM's stream after vLLM's writes, read back
  without blocking.

One INFO line every ``MTPSTATE_SHADOW_LOG_EVERY`` steps (default 1000):
steps compared, disagreements, the shadow's host cost per step. The first
disagreement, or any exception of the shadow's own (a request mtpstate
refuses, a bug), ends shadowing with one WARNING in full and frees the
shadow's memory; nothing is ever raised into vLLM.
"""

from __future__ import annotations

import functools
import logging
import os

from mtpstate.integrations.vllm.shadow.monitor import Shadow, _Unsupported

__all__ = ["EVERY_VAR", "LOG_EVERY_VAR", "Shadow", "install", "setting", "shadow_of"]

EVERY_VAR = "MTPSTATE_SHADOW_EVERY"
LOG_EVERY_VAR = "MTPSTATE_SHADOW_LOG_EVERY"
DEFAULT_EVERY = 16
DEFAULT_LOG_EVERY = 1000

logger = logging.getLogger("vllm.mtpstate")

_MARK = "__mtpstate_shadow__"  # marks a wrapper set by install()
_ATTR = "_mtpstate_shadow"  # a live runner's Shadow (None: none, or stopped before it began)
_METHODS: dict = {}  # the patched methods, as install() was given them
_OPS = None  # tests: the shadow mirror's device operations
_CLASS: list = []  # the runner class install() wrapped
_OBSERVED = ("initialize_kv_cache", "add_requests", "update_requests", "prepare_inputs")


def setting(name: str, default: int, warn: bool = True) -> int:
    """The whole number >= 1 the environment variable ``name`` sets (else
    ``default``, with a WARNING when it is set to something else)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
        if value < 1:
            raise ValueError
    except ValueError:
        if warn:
            logger.warning("mtpstate shadow: %s=%r is not a whole number >= 1; using %d", name, raw, default)
        return default
    return value


def shadow_of(runner) -> Shadow | None:
    """The runner's shadow (built the first time it is asked for); None
    where there is none or it has stopped."""
    sh = runner.__dict__.get(_ATTR, _ATTR)
    if sh is _ATTR:
        if getattr(runner, "req_states", None) is None or getattr(runner, "block_tables", None) is None:
            return None  # (its KV cache is not initialized yet: asked again later)
        sh = runner.__dict__[_ATTR] = _build(runner)
    return sh if sh is not None and sh.active else None


def _build(runner) -> Shadow | None:
    try:
        sh = Shadow(
            runner,
            _METHODS,
            _CLASS[0],
            every=setting(EVERY_VAR, DEFAULT_EVERY),
            log_every=setting(LOG_EVERY_VAR, DEFAULT_LOG_EVERY),
            ops=_OPS,
        )
    except _Unsupported as e:
        logger.info("mtpstate shadow: not used for %s; vLLM runs as always", e)
        return None
    except Exception as e:  # noqa: BLE001  (never into vLLM)
        logger.warning("mtpstate shadow: could not be set up (%s: %s); vLLM runs as always", type(e).__name__, e)
        return None
    logger.info(
        "mtpstate shadow: on; comparing every step with vLLM's runner, device tensors every %d batches; "
        "the shadow holds %.1f MiB of device memory%s",
        sh.every,
        sh.device_bytes / 2**20,
        "" if sh.runner.sampler is not None else f" (sampler not compared: {sh.runner.sampler_reason})",
    )
    return sh


def _guarded(sh: Shadow, where: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001  (never into vLLM: the shadow ends)
        sh.fail(where, e)


def _wrap(original, after):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            after(self, result, *args, **kwargs)
        except Exception:  # noqa: BLE001  (never into vLLM)
            logger.exception("mtpstate shadow: internal error; vLLM runs on")
        return result

    setattr(wrapper, _MARK, True)
    return wrapper


def _after_init(runner, result, *args, **kwargs) -> None:
    runner.__dict__.pop(_ATTR, None)  # (a re-initialized KV cache: a new shadow)
    shadow_of(runner)


def _after_update(runner, result, scheduler_output) -> None:
    sh = shadow_of(runner)
    if sh is not None:
        _guarded(sh, "update_requests", sh.after_update, scheduler_output)


def _after_prepare(runner, result, scheduler_output, batch_req_state, batch_desc, *args, **kwargs) -> None:
    sh = shadow_of(runner)
    if sh is not None and sh.steps:
        _guarded(sh, "prepare_inputs", sh.after_prepare, scheduler_output, batch_req_state, batch_desc, result)


def install(module, methods: dict, ops=None) -> None:
    """Set the shadow's wrappers on ``module.GPUModelRunner`` (once);
    ``methods``: the patched runner methods the shadow runs on its own
    runner; ``ops``: tests' device operations for the shadow's mirror."""
    global _OPS
    cls = module.GPUModelRunner
    own = vars(cls)
    missing = [m for m in _OBSERVED if m not in own]
    if missing:
        raise TypeError(f"{cls.__qualname__} has no {', '.join(missing)} of its own: shadow mode observes them")
    _CLASS[:] = [cls]
    _METHODS.clear()
    _METHODS.update(methods)
    _OPS = ops
    if getattr(own["update_requests"], _MARK, False):
        return
    add = own["add_requests"]

    @functools.wraps(add)
    def add_requests(self, scheduler_output):
        try:
            sh = shadow_of(self)
            if sh is not None:
                _guarded(sh, "add_requests", sh.before_add, scheduler_output)
        except Exception:  # noqa: BLE001  (never into vLLM)
            logger.exception("mtpstate shadow: internal error; vLLM runs on")
        return add(self, scheduler_output)

    setattr(add_requests, _MARK, True)
    # every wrapper made before any is set: never half set up
    wrappers = {
        "add_requests": add_requests,
        "initialize_kv_cache": _wrap(own["initialize_kv_cache"], _after_init),
        "update_requests": _wrap(own["update_requests"], _after_update),
        "prepare_inputs": _wrap(own["prepare_inputs"], _after_prepare),
    }
    for name, fn in wrappers.items():
        setattr(cls, name, fn)
    logger.info("mtpstate: shadow mode set up on %s.GPUModelRunner", module.__name__)
