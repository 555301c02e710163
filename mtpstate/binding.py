"""Scheduler output -> the step kernel's inputs: what ``RequestTable.apply``
reads of the scheduler's objects, once each, into a :class:`Step` (the
addresses the kernel dereferences, held for the whole call), and the Python
readers and validators for the shapes the kernel does not read in place
(generators, numpy arrays, str subclasses, ...), which raise a
:class:`~mtpstate.StateError` naming the request and the field."""

from __future__ import annotations

import array
import operator
import sys

import numpy as np

from mtpstate._kernels import slots as T
from mtpstate._kernels import status as K
from mtpstate._kernels.cpython import ARRAY_LAYOUT_OK
from mtpstate.errors import DuplicateRequestError, InvalidStepError, StateError
from mtpstate.index import canonical_ids, key_text

__all__ = ["Step", "bind", "canonicalize", "describe_new", "new_from_held", "read_cached"]


def _as_int(x, what: str) -> int:
    if isinstance(x, (bool, np.bool_)):
        raise InvalidStepError(f"{what} must be an int, got bool {x!r}")
    try:
        return operator.index(x)
    except Exception:
        raise InvalidStepError(f"{what} must be an int, got {type(x).__name__} {_short(x)}") from None


def _short(x) -> str:
    try:
        r = repr(x)
    except Exception:
        return "<unprintable>"
    return r if len(r) <= 60 else r[:57] + "..."


def _int_list(seq, what: str) -> list:
    if isinstance(seq, np.ndarray):
        if seq.dtype.kind not in "iu" or seq.ndim != 1:
            raise InvalidStepError(f"{what} must be a 1-d sequence of ints, got a {seq.ndim}-d {seq.dtype} array")
        return seq.tolist()
    if seq is None or isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
        raise InvalidStepError(f"{what} must be a sequence of ints, got {type(seq).__name__}")
    try:
        items = list(seq)
    except StateError:
        raise
    except Exception as e:
        raise InvalidStepError(f"{what}: iterating it failed: {e!r}") from None
    return [_as_int(x, what) for x in items]


def _blocks(b, what: str):
    """One list of block ids per KV-cache group (canonical form)."""
    if b is None:
        return None
    if isinstance(b, (str, bytes, np.ndarray)) or not hasattr(b, "__iter__"):
        raise InvalidStepError(f"{what} must be a tuple with one list of block ids per KV-cache group")
    try:
        groups = list(b)
    except Exception as e:
        raise InvalidStepError(f"{what}: iterating it failed: {e!r}") from None
    return tuple(_int_list(g, what) for g in groups)


def _collection(x, what: str, keep: list):
    """A collection given by the scheduler (ids, per-request values) as an
    exact list or tuple the kernel can read in place; anything else is
    materialized here, once (a generator is consumed exactly once)."""
    t = type(x)
    if t is list or t is tuple:
        return x
    if x is None:
        raise InvalidStepError(f"{what} is None")
    if isinstance(x, (str, bytes)):
        raise InvalidStepError(f"{what} must be a collection, got a single {t.__name__} {_short(x)}")
    if isinstance(x, np.ndarray):
        if x.ndim != 1:
            raise InvalidStepError(f"{what} must be 1-d, got a {x.ndim}-d array")
        x = x.tolist()
    else:
        try:
            x = list(x)
        except StateError:
            raise
        except Exception:
            raise InvalidStepError(f"{what} must be a collection, got {t.__name__} {_short(x)}") from None
    keep.append(x)
    return x


def _ids_or_none(x, what: str, keep: list):
    """A collection of ids as an exact list/tuple, or None when empty."""
    t = type(x)
    if t is list or t is tuple:
        return x if x else None
    if t is set or t is frozenset:
        if not x:
            return None
        x = list(x)  # iterating a set calls no __hash__/__eq__
        keep.append(x)
        return x
    return _collection(x, what, keep) or None


def _dict_of(x, what: str, keep: list) -> dict:
    """A mapping given by the scheduler as an exact dict the kernel iterates
    in place; anything else is copied here, once, in its own order."""
    if type(x) is dict:
        return x
    if isinstance(x, (str, bytes)) or not hasattr(x, "keys"):
        raise InvalidStepError(f"{what} must be a dict, got {type(x).__name__} {_short(x)}")
    try:
        d = {k: x[k] for k in list(x.keys())}
    except StateError:
        raise
    except Exception as e:
        raise InvalidStepError(f"{what}: reading it failed: {e!r}") from None
    keep.append(d)
    return d


_NP_KINDS = {("i", 4): K.V_I32, ("i", 8): K.V_I64, ("u", 4): K.V_U32, ("u", 8): K.V_U64}
_ARRAY_CODES = frozenset("ilqILQ")
_BUF_SIGNED = {"i": True, "l": True, "q": True, "I": False, "L": False, "Q": False}


def _int_vector(x, keep: list):
    """(kind, address, length) of an int sequence the kernel reads in place
    (list, tuple, array.array, a 1-d C-contiguous numpy array or buffer of
    4- or 8-byte ints), or None when it needs the Python conversion."""
    t = type(x)
    if t is list or t is tuple:
        return K.V_OBJ, id(x), 0
    if isinstance(x, array.array):
        if ARRAY_LAYOUT_OK and x.typecode in _ARRAY_CODES:
            return K.V_ARRAY, id(x), 0  # layout read by the kernel, under the GIL
        return None
    if isinstance(x, np.ndarray):
        kind = _NP_KINDS.get((x.dtype.kind, x.dtype.itemsize))
        if kind is None or x.ndim != 1 or not x.flags.c_contiguous or not x.dtype.isnative:
            return None
        # holding the array keeps its data: numpy refuses to resize a
        # referenced array
        keep.append(x)
        return kind, x.__array_interface__["data"][0], len(x)
    try:
        m = memoryview(x)
    except Exception:
        return None
    fmt = m.format.lstrip("@=")
    if m.ndim != 1 or not m.c_contiguous or fmt not in _BUF_SIGNED or m.itemsize not in (4, 8):
        m.release()
        return None
    kind = _NP_KINDS[("i" if _BUF_SIGNED[fmt] else "u", m.itemsize)]
    # the export held by the memoryview keeps the exporter from resizing
    arr = np.frombuffer(m, dtype=np.uint8)
    keep.append((m, arr))
    return kind, (arr.__array_interface__["data"][0] if len(arr) else 0), len(m)


class _NewRequest:
    """The attributes of one new request, each read once."""

    __slots__ = ("req_id", "prompt_len", "tokens", "block_ids", "num_computed_tokens", "max_tokens")

    def __init__(self, req_id, prompt_len, tokens, block_ids, num_computed_tokens, max_tokens):
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.tokens = tokens
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.max_tokens = max_tokens


# the attributes of a NewRequestData the kernel reads in place, by holder
# slot (``H_*``); slot H_REQ carries array.array, the base type of the token
# containers it reads as raw arrays. Interned: the kernel passes these very
# objects to PyObject_GetAttr.
_NEW_ATTRS = ("req_id", "prompt_token_ids", "prefill_token_ids", "block_ids", "num_computed_tokens", "sampling_params")
_NEW_NAMES = (array.array, *(sys.intern(a) for a in _NEW_ATTRS), sys.intern("max_tokens"))
_NEW_NAMES_ADDR = np.array([id(x) for x in _NEW_NAMES], np.int64)
_NO_VALUE = object()


def _read_new_request(r, k: int, held=(), failed=None) -> _NewRequest:
    """Bind one NewRequestData: read each attribute once, check the types
    that cannot be checked by the kernel, leave ranges to the kernel.
    ``held``: the values of the first attributes (``_NEW_ATTRS`` order, then
    max_tokens) as the kernel read them, and ``failed``, the exception the
    next read raised: those are not read again."""

    def read(i, obj, name, default=_NO_VALUE):
        if i < len(held):
            return held[i]
        try:
            if i == len(held) and failed is not None:
                raise failed
            return getattr(obj, name)
        except AttributeError:
            if default is _NO_VALUE:
                raise
            return default

    try:
        rid = read(0, r, "req_id")
    except Exception as e:
        raise InvalidStepError(f"new request #{k}: reading req_id raised {e!r}") from None
    if not isinstance(rid, str):
        raise InvalidStepError(f"new request #{k}: req_id must be str, got {type(rid).__name__} {_short(rid)}")
    name = ""
    try:
        name = "prompt_token_ids"
        prompt = read(1, r, name)
        name = "prefill_token_ids"
        tokens = read(2, r, name, None)
        name = "block_ids"
        blocks = read(3, r, name)
        name = "num_computed_tokens"
        nct = read(4, r, name)
        name = "sampling_params"
        sp = read(5, r, name)
        name = "sampling_params.max_tokens"
        max_tokens = read(6, sp, "max_tokens") if sp is not None else None
    except Exception as e:
        raise InvalidStepError(f"new request {rid!r}: reading {name} raised {e!r}") from None
    return _new_request_of(r, rid, prompt, tokens, blocks, nct, max_tokens)


def _new_request_of(r, rid, prompt, tokens, blocks, nct, max_tokens) -> _NewRequest:
    tb = type(blocks)
    if (
        type(rid) is str
        and type(nct) is int
        and (max_tokens is None or type(max_tokens) is int)
        and (tb is tuple or tb is list)
        and isinstance(prompt, _FAST_SEQ)
        and (tokens is None or isinstance(tokens, _FAST_SEQ))
    ):
        # the usual shape (vLLM's NewRequestData): exact types; every item
        # and range is checked by the kernel
        return _NewRequest(
            rid, len(prompt), prompt if tokens is None else tokens, blocks, nct, 1 if max_tokens is None else max_tokens
        )
    return _check_new_request(r, rid, prompt, tokens, blocks, nct, max_tokens)


_FAST_SEQ = (list, tuple, array.array)


def _check_new_request(r, rid, prompt, tokens, blocks, nct, max_tokens) -> _NewRequest:
    """The values of one new request, read once by ``_read_new_request``,
    for any other shape: every type checked, generators consumed once."""
    who = f"new request {rid!r}"
    if prompt is not None and not hasattr(prompt, "__len__"):
        prompt = _int_list(prompt, f"{who}: prompt_token_ids")  # a generator: read it once
    if tokens is None:
        tokens = prompt
    elif not hasattr(tokens, "__len__"):
        tokens = _int_list(tokens, f"{who}: prefill_token_ids")
    if tokens is None:
        raise InvalidStepError(f"{who}: prefill_token_ids and prompt_token_ids are both None")
    if prompt is not None:
        try:
            prompt_len = len(prompt)
        except Exception as e:
            raise InvalidStepError(f"{who}: prompt_token_ids: {e!r}") from None
    else:  # prompt embeddings: the length comes from the request
        try:
            prompt_len = r.prompt_len
        except Exception as e:
            raise InvalidStepError(f"{who}: prompt_len: {e!r}") from None
    if blocks is None:
        raise InvalidStepError(f"{who}: block_ids is None")
    t = type(blocks)
    if not ((t is tuple or t is list) and all(type(g) is list or type(g) is tuple for g in blocks)):
        blocks = _blocks(blocks, f"{who}: block_ids")
    return _NewRequest(
        rid,
        _as_int(prompt_len, f"{who}: prompt_len"),
        tokens,
        blocks,
        _as_int(nct, f"{who}: num_computed_tokens"),
        1 if max_tokens is None else _as_int(max_tokens, f"{who}: sampling_params.max_tokens"),
    )


class Step:
    """One step's inputs, bound: every attribute read once, every object the
    kernel will dereference held here for the whole call."""

    __slots__ = (
        "fin",
        "pre",
        "new",
        "reqs",
        "cid",
        "cnct",
        "cblk",
        "cres",
        "keep",
        "desc",
        "vec",
        "nst",
        "spec",
        "total",
    )

    def __init__(self):
        self.fin = self.pre = self.cid = self.cnct = self.cblk = self.cres = self.desc = self.vec = None
        self.nst = self.spec = self.total = self.reqs = None
        self.new = ()
        self.keep = []


def read_cached(cached) -> tuple:
    """(req_ids, num_computed_tokens, new_block_ids, resumed_req_ids) of
    ``scheduled_cached_reqs``, each attribute read once."""
    if cached is None:
        raise InvalidStepError("scheduled_cached_reqs is None")
    try:
        cid = cached.req_ids
        cnct = cached.num_computed_tokens
        cblk = cached.new_block_ids
        cres = getattr(cached, "resumed_req_ids", None)
    except StateError:
        raise  # (a re-entrant call from a property)
    except Exception as e:
        raise InvalidStepError(f"scheduled_cached_reqs: {e!r}") from None
    return cid, cnct, cblk, cres


def bind(fin, pre, new_reqs, cached, batch) -> Step:
    """Read the step's inputs once into a _Step (see its docstring).
    ``cached``: the fields from ``_read_cached`` or None; ``batch``:
    (num_scheduled_tokens, scheduled_spec_decode_tokens,
    total_num_scheduled_tokens) or None."""
    b = Step()
    keep = b.keep
    if fin is not None:
        b.fin = _ids_or_none(fin, "finished_req_ids", keep)
    if pre is not None:
        b.pre = _ids_or_none(pre, "preempted_req_ids", keep)
    if new_reqs is not None:
        t = type(new_reqs)
        if t is list or t is tuple:
            if new_reqs:
                b.reqs = new_reqs  # read in place by the kernel
        else:
            new_reqs = _collection(new_reqs, "scheduled_new_reqs", keep)
            if new_reqs:
                b.new = [_read_new_request(r, k) for k, r in enumerate(new_reqs)]
    if cached is not None:
        cid, cnct, cblk, cres = cached
        t = type(cid)
        if t is not list and t is not tuple:
            cid = _collection(cid, "scheduled_cached_reqs.req_ids", keep)
        t = type(cnct)
        if t is list or t is tuple:
            vec = (K.V_OBJ, id(cnct), 0)
        else:
            if cnct is None:
                raise InvalidStepError("scheduled_cached_reqs.num_computed_tokens is None")
            vec = _int_vector(cnct, keep)
            if vec is None:
                cnct = _collection(cnct, "scheduled_cached_reqs.num_computed_tokens", keep)
                vec = (K.V_OBJ, id(cnct), 0)
        t = type(cblk)
        if t is not list and t is not tuple:
            cblk = _collection(cblk, "scheduled_cached_reqs.new_block_ids", keep)
        # the three lists are checked for equal length even when empty
        b.cid = cid
        b.cnct = cnct
        b.vec = vec
        b.cblk = cblk
        if cres is not None:
            b.cres = _ids_or_none(cres, "scheduled_cached_reqs.resumed_req_ids", keep)
    if batch is not None:
        nst, spec, total = batch
        b.nst = _dict_of(nst, "num_scheduled_tokens", keep)
        if spec is not None:
            b.spec = _dict_of(spec, "scheduled_spec_decode_tokens", keep)
        if total is not None and type(total) is not int:
            total = _as_int(total, "total_num_scheduled_tokens")
        b.total = total
    return b


def describe_new(b: Step) -> None:
    """The flat list of new-request descriptors the kernel reads."""
    desc = []
    keep = b.keep
    for r in b.new:
        vec = _int_vector(r.tokens, keep)
        if vec is None:  # exotic token container: converted here
            r.tokens = _int_list(r.tokens, f"new request {r.req_id!r}: prefill_token_ids")
            vec = (K.V_OBJ, id(r.tokens), 0)
        desc += (id(r.req_id), r.prompt_len, r.num_computed_tokens, r.max_tokens, *vec, id(r.block_ids))
    b.desc = desc


def canonicalize(b: Step) -> None:
    """The generic path: every input as lists of exact str / int (bytes
    for ids with no UTF-8 form), or a StateError naming what is wrong.
    Works on the bound values: nothing is read from the scheduler again."""
    keep = b.keep
    if b.fin is not None:
        b.fin = canonical_ids(b.fin, "finished request id")
    if b.pre is not None:
        b.pre = canonical_ids(b.pre, "preempted request id")
    for r in b.new:
        (r.req_id,) = canonical_ids([r.req_id], "new request id")
        who = f"new request {key_text(r.req_id)!r}"
        r.tokens = _int_list(r.tokens, f"{who}: prefill_token_ids")
        r.block_ids = _blocks(r.block_ids, f"{who}: block_ids")
    if b.cres is not None:
        b.cres = canonical_ids(b.cres, "resumed request id")
    if b.cid is not None:
        ids = canonical_ids(b.cid, "cached request id")
        n = len(ids)
        cnct = _int_list(b.cnct, "scheduled_cached_reqs.num_computed_tokens")
        if len(cnct) != n or len(b.cblk) != n:
            raise InvalidStepError(
                f"cached request lists differ in length: req_ids {n}, "
                f"num_computed_tokens {len(cnct)}, new_block_ids {len(b.cblk)}"
            )
        b.cblk = [_blocks(x, f"cached request {key_text(r)!r}: new_block_ids") for r, x in zip(ids, b.cblk)]
        b.cid = ids
        b.cnct = cnct
        b.vec = (K.V_OBJ, id(cnct), 0)
    if b.nst is not None:
        items = list(b.nst.items())
        ids = canonical_ids([k for k, _ in items], "scheduled request id")
        counts = [
            _as_int(v, f"scheduled request {key_text(r)!r}: num_scheduled_tokens") for (_, v), r in zip(items, ids)
        ]
        b.nst = dict(zip(ids, counts))
        if len(b.nst) != len(ids):
            raise DuplicateRequestError("num_scheduled_tokens lists an id twice")
    if b.spec is not None:
        spec = {}
        for k, v in list(b.spec.items()):
            if not isinstance(k, str):
                continue  # never equal to a scheduled id: vLLM ignores it too
            (key,) = canonical_ids([k], "scheduled_spec_decode_tokens id")
            if type(v) is not list and type(v) is not tuple:
                try:
                    v = (0,) * len(v)
                except Exception:
                    raise InvalidStepError(
                        f"scheduled_spec_decode_tokens entry {key_text(key)!r}: the draft tokens must be a "
                        f"list, got {type(v).__name__} {_short(v)}"
                    ) from None
            spec[key] = v
        b.spec = spec
    keep.append((b.fin, b.pre, b.cid, b.cnct, b.cblk, b.cres, b.nst, b.spec))
    describe_new(b)


def new_from_held(b: Step, status: int, held, ctx) -> None:
    """The step's new requests as ``_NewRequest`` descriptors, from what
    the kernel read of them (the holder list) and, past where it
    stopped, read here; raises what reading them raises."""
    reqs = b.reqs
    b.reqs = None
    if status == K.E_CHANGED and int(ctx[T.TB_ERR_PHASE]) == K.PH_NEW:
        raise InvalidStepError("scheduled_new_reqs changed while the step read it")
    stop, failed_slot = len(reqs), -1
    if status == K.E_NEW_READ:
        stop, failed_slot = int(ctx[T.TB_ERR_POS]), int(ctx[T.TB_ERR_ARG])
    elif held is None:
        stop = 0  # stopped before reading anything (more new requests than rows)
    S = T.H_STRIDE
    new = []
    for k, r in enumerate(reqs):
        if k < stop:
            # (req_id .. num_computed_tokens, then max_tokens: None where
            # sampling_params is None, the kernel did not read it)
            vals = held[k * S + T.H_REQ_ID : k * S + S]
            new.append(_new_request_of(held[k * S], *vals[: T.H_SP - 1], vals[T.H_MAX_TOKENS - 1]))
        elif k == stop and failed_slot >= 0:
            base = k * S
            new.append(_read_new_request(held[base], k, held[base + 1 : base + failed_slot], held[base + failed_slot]))
        else:
            new.append(_read_new_request(r, k))
    b.new = new
    describe_new(b)
