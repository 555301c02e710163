"""RequestTable: apply a whole scheduler step in one batched call.

Data flow: scheduler output (Python objects, duck-typed like vLLM's
``SchedulerOutput``) -> ``apply`` binds the step (the addresses of the
scheduler's own lists and dicts; new requests are read by the kernel, or by
``_read_new_request`` for shapes it does not read) ->
``_kernels.step.tb_apply`` validates the whole step and applies it to the
host arrays (and appends the changes to the mirror's staging buffers) ->
``mirror.DeviceMirror`` ships them to device tensors.
"""

from __future__ import annotations

import array
import math
import operator
import sys
from _thread import get_ident as _get_ident

import numpy as np

from mtpstate._kernels import index as K
from mtpstate._kernels import slots as T
from mtpstate._kernels.native import ARRAY_LAYOUT_OK
from mtpstate._kernels.step import tb_apply
from mtpstate.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidStepError,
    StateError,
    UnknownRequestError,
)
from mtpstate.index import RequestIndex, canonical_ids, key_text

__all__ = ["RequestTable"]


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


class StepResult:
    """The rows of the step just applied, for the engine's next moves.

    Every attribute is a view of an array the table preallocates: valid
    until the next call that changes the table (``apply``, ``finish``,
    ``add``, ``update``), accepted or not. Copy what must outlive it.

    Attributes
    ----------
    cached_rows : np.ndarray[int32]
        Rows of ``scheduled_cached_reqs.req_ids``, in their order.
    new_rows : np.ndarray[int32]
        Rows assigned to ``scheduled_new_reqs``, in their order.
    rows : np.ndarray[int32]
        ``cached_rows`` followed by ``new_rows`` (one array): the batch in
        the scheduler's order, ready for a gather into the engine's order.
    freed_rows : np.ndarray[int32]
        Rows freed by the step (finished, preempted, and live rows of
        re-sent new requests), ascending: the order they were freed in.
    batch : BatchReqState or None
        The step's batch in vLLM's batch order (see :class:`BatchReqState`).
    """

    __slots__ = ("_res", "_ctx", "_R", "_batch")

    def __init__(self, res, ctx, R, batch):
        self._res = res
        self._ctx = ctx
        self._R = R
        self._batch = batch

    @property
    def batch(self) -> BatchReqState | None:
        """The step's batch, as vLLM's ``gather_batch_req_state`` builds it,
        or None when the table has no ``decode_query_len`` or the step no
        ``num_scheduled_tokens``."""
        n = self._ctx[T.TB_B_N]
        if n < 0:
            return None
        b = self._batch
        if b._n != n:
            b._resize(n)
        return b

    @property
    def cached_rows(self) -> np.ndarray:
        return self._res[: self._ctx[T.TB_RES_NC]]

    @property
    def new_rows(self) -> np.ndarray:
        nc = self._ctx[T.TB_RES_NC]
        return self._res[nc : nc + self._ctx[T.TB_RES_NN]]

    @property
    def rows(self) -> np.ndarray:
        return self._res[: self._ctx[T.TB_RES_NC] + self._ctx[T.TB_RES_NN]]

    @property
    def freed_rows(self) -> np.ndarray:
        R2 = 2 * self._R
        return self._res[R2 : R2 + self._ctx[T.TB_RES_NF]]

    def __repr__(self) -> str:
        return (
            f"StepResult(cached_rows={self.cached_rows.tolist()}, new_rows={self.new_rows.tolist()}, "
            f"freed_rows={self.freed_rows.tolist()})"
        )


class BatchReqState:
    """The step's batch, field for field vLLM 0.34's ``BatchReqState``
    (``gather_batch_req_state`` in ``vllm/v1/worker/gpu/model_runner.py``),
    computed by the step's kernel call. Only a table built with
    ``decode_query_len`` makes one, from the step's ``num_scheduled_tokens``
    and ``scheduled_spec_decode_tokens``.

    The arrays are views of arrays the table preallocates, valid until the
    next call that changes the table, like :class:`StepResult`'s; ``req_ids``
    is a new list every step (made by the kernel).

    Attributes
    ----------
    req_ids : list[str]
        The scheduled ids in batch order: ``sort_batch_req_ids``' order
        (requests with drafts first; within each, ``decode_query_len``
        tokens first, then by scheduled tokens; ties in dict order).
    num_scheduled_tokens : np.ndarray[int32]
    num_tokens : int
        Sum of ``num_scheduled_tokens`` (checked against the step's
        ``total_num_scheduled_tokens`` when it has one).
    num_draft_tokens_np : np.ndarray[int32] or None
        Draft tokens per request; None when the step has no drafts.
    idx_mapping_np : np.ndarray[intp]
        Batch position -> row.
    prefill_len_np, num_computed_prefill_tokens_np, max_seq_len_np : np.ndarray[int32]
        Those rows' state after the step.
    is_prefilling_np : np.ndarray[bool]
    has_prefill : bool
    prefill_runs_as_decode_np : np.ndarray[bool] or None
        Prefilling with one new token over existing context (runs as a
        decode); None when nothing prefills.
    decode_graph_eligible : bool
    max_query_len : int
        ``max(num_scheduled_tokens)``, 0 for an empty batch.
    """

    __slots__ = (
        "_ctx",
        "_b",
        "_idx",
        "_bb",
        "_n",
        "_holder",
        "num_scheduled_tokens",
        "_num_draft_tokens",
        "idx_mapping_np",
        "prefill_len_np",
        "num_computed_prefill_tokens_np",
        "max_seq_len_np",
        "is_prefilling_np",
        "_prefill_runs_as_decode",
    )

    def __init__(self, ctx, b, idx, bb, holder):
        self._ctx = ctx
        self._b = b  # [B_ROWS, max_num_reqs] int32
        self._idx = idx  # [max_num_reqs] intp
        self._bb = bb  # [BB_ROWS, max_num_reqs] bool
        self._holder = holder  # [the last batch's req_ids], put there by the kernel
        self._resize(0)

    @property
    def req_ids(self) -> list:
        return self._holder[0]

    def _resize(self, n: int) -> None:
        # views change only when the batch size does (steady decode: never)
        b, bb = self._b, self._bb
        self._n = n
        self.num_scheduled_tokens = b[T.B_NUM_SCHED, :n]
        self._num_draft_tokens = b[T.B_DRAFTS, :n]
        self.prefill_len_np = b[T.B_PREFILL, :n]
        self.num_computed_prefill_tokens_np = b[T.B_NCPT, :n]
        self.max_seq_len_np = b[T.B_MAXSEQ, :n]
        self.idx_mapping_np = self._idx[:n]
        self.is_prefilling_np = bb[T.BB_PREFILLING, :n]
        self._prefill_runs_as_decode = bb[T.BB_RUNS_AS_DECODE, :n]

    @property
    def num_tokens(self) -> int:
        return self._ctx[T.TB_B_NUM_TOKENS]

    @property
    def num_draft_tokens_np(self) -> np.ndarray | None:
        return self._num_draft_tokens if self._ctx[T.TB_B_HAS_DRAFTS] else None

    @property
    def has_prefill(self) -> bool:
        return bool(self._ctx[T.TB_B_HAS_PREFILL])

    @property
    def prefill_runs_as_decode_np(self) -> np.ndarray | None:
        return self._prefill_runs_as_decode if self._ctx[T.TB_B_HAS_PREFILL] else None

    @property
    def decode_graph_eligible(self) -> bool:
        return bool(self._ctx[T.TB_B_GRAPH_OK])

    @property
    def max_query_len(self) -> int:
        return self._ctx[T.TB_B_MAX_QUERY]

    FIELDS = (
        "req_ids",
        "num_scheduled_tokens",
        "num_tokens",
        "num_draft_tokens_np",
        "idx_mapping_np",
        "prefill_len_np",
        "num_computed_prefill_tokens_np",
        "is_prefilling_np",
        "max_seq_len_np",
        "has_prefill",
        "prefill_runs_as_decode_np",
        "decode_graph_eligible",
        "max_query_len",
    )

    def as_dict(self) -> dict:
        """Every field by name (arrays still views)."""
        return {f: getattr(self, f) for f in self.FIELDS}

    def copy_arrays(self) -> dict:
        """The per-request arrays by field name, copied (they outlive the
        next call): three copies in all, of the int32, bool and index blocks,
        each field a view of its block. Fields that are None stay None."""
        n = self._n
        ints = self._b[: T.B_MAXSEQ + 1, :n].copy()  # [5, n]: the int32 outputs are rows 0..B_MAXSEQ
        bools = self._bb[:, :n].copy()  # [BB_ROWS, n]
        has_prefill = self._ctx[T.TB_B_HAS_PREFILL]
        return {
            "num_scheduled_tokens": ints[T.B_NUM_SCHED],
            "num_draft_tokens_np": ints[T.B_DRAFTS] if self._ctx[T.TB_B_HAS_DRAFTS] else None,
            "idx_mapping_np": self._idx[:n].copy(),
            "prefill_len_np": ints[T.B_PREFILL],
            "num_computed_prefill_tokens_np": ints[T.B_NCPT],
            "max_seq_len_np": ints[T.B_MAXSEQ],
            "is_prefilling_np": bools[T.BB_PREFILLING],
            "prefill_runs_as_decode_np": bools[T.BB_RUNS_AS_DECODE] if has_prefill else None,
        }

    def __repr__(self) -> str:
        return f"BatchReqState(num_reqs={self._n}, num_tokens={self.num_tokens}, req_ids={self.req_ids[:4]}...)"


_FIELD_NAMES = {
    K.FLD_NONE: "",
    K.FLD_REQ_ID: "req_id",
    K.FLD_PROMPT_LEN: "prompt_len",
    K.FLD_TOKENS: "prefill_token_ids",
    K.FLD_NCT: "num_computed_tokens",
    K.FLD_MAX_TOKENS: "sampling_params.max_tokens",
    K.FLD_BLOCKS: "block_ids",
    K.FLD_COUNT: "num_scheduled_tokens",
    K.FLD_DRAFTS: "scheduled_spec_decode_tokens",
    K.FLD_TOTAL: "total_num_scheduled_tokens",
}
_PHASE_NAMES = {
    K.PH_FINISH: "finished request",
    K.PH_PREEMPT: "preempted request",
    K.PH_NEW: "new request",
    K.PH_CACHED: "cached request",
    K.PH_RESUMED: "resumed request",
    K.PH_BATCH: "scheduled request",
    K.PH_SPEC: "scheduled_spec_decode_tokens entry",
}


class _Step:
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

    def args(self) -> tuple:
        """The kernel's argument tuple (``A_*`` slots)."""
        kind, addr, n = self.vec if self.vec is not None else (0, 0, 0)
        return (
            self.fin,
            self.pre,
            self.desc or None,
            self.cid,
            kind,
            addr,
            n,
            self.cblk,
            self.cres,
            self.nst,
            self.spec,
            self.total,
            self.reqs,
        )


class RequestTable:
    """Per-request state in flat arrays indexed by row, updated one scheduler
    step at a time.

    Parameters
    ----------
    max_num_reqs : int
        Rows (the most requests live at once).
    max_model_len : int
        Longest sequence; the width of ``token_ids``.
    block_sizes : sequence of int
        Block size of each KV-cache group.
    max_num_blocks_per_group : sequence of int, optional
        Width of each group's block table; default
        ``ceil(max_model_len / block_size)``.
    device : str or torch.device, optional
        Mirror the state to torch tensors on this device (``"cuda"``, or
        ``"cpu"`` to run the same machinery without a GPU). None: host only.
    mirror_options : dict, optional
        Passed to :class:`mtpstate.mirror.DeviceMirror` (``ring_depth``,
        ``token_ids_on_device``, ``fields``, ``engine_lengths``,
        ``token_ids_target``, ``idx_mapping``, ``zero_rows_on_add``,
        ``graphs``, ``ops``).
    seed : int, optional
        Hash seed of the request index (rows never depend on it).
    max_id_bytes : int
        Longest request id accepted, in UTF-8 bytes (default 65536). Ids can
        come from clients: ids of up to 56 bytes live in the row, longer ones
        in an arena sized by the live long ids (returned as they finish).
        A step with a longer new id is refused with an InvalidStepError
        naming it; check ids when admitting requests with
        :meth:`accepts_request_id`, so that one request is turned away
        instead of a step failing.
    prefault : bool
        Touch every page of the host arrays now (default), so that no step
        pays the kernel's page faults (zeroing a 2 MiB huge page takes
        ~100 us) the first time it writes a row.
    decode_query_len : int, optional
        vLLM's ``decode_query_len`` (speculative steps + 1). When set,
        ``apply`` also builds the step's batch (``StepResult.batch``, vLLM's
        ``BatchReqState``) from ``num_scheduled_tokens`` and
        ``scheduled_spec_decode_tokens`` in the same kernel call. None
        (default): no batch, nothing extra paid.

    Notes
    -----
    The host arrays are the source of truth; the attributes below are views
    of them, valid for the table's lifetime. Rows are assigned lowest-free
    first, so tensor-parallel ranks fed the same steps agree.

    Threads: calls that change the table are serialized by a lock (a second
    thread waits); a call made from inside another (a scheduler object's
    property that calls back into the table) raises StateError.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_sizes=(16,),
        max_num_blocks_per_group=None,
        *,
        device=None,
        mirror_options: dict | None = None,
        seed: int | None = None,
        max_id_bytes: int = 65536,
        prefault: bool = True,
        decode_query_len: int | None = None,
        _hash_bits: int = 63,
    ):
        R = operator.index(max_num_reqs)
        L = operator.index(max_model_len)
        if R <= 0 or L <= 0:
            raise ValueError("max_num_reqs and max_model_len must be positive")
        block_sizes = [operator.index(b) for b in block_sizes]
        if not block_sizes or any(b <= 0 for b in block_sizes):
            raise ValueError("block_sizes must be a non-empty sequence of positive ints")
        if max_num_blocks_per_group is None:
            widths = [math.ceil(L / b) for b in block_sizes]
        else:
            widths = [operator.index(w) for w in max_num_blocks_per_group]
            if len(widths) != len(block_sizes) or any(w <= 0 for w in widths):
                raise ValueError("max_num_blocks_per_group needs one positive width per group")
        ng = len(block_sizes)
        self.max_num_reqs = R
        self.max_model_len = L
        self.block_sizes = tuple(block_sizes)
        self.max_num_blocks_per_group = tuple(widths)
        self.num_groups = ng
        self._index = RequestIndex(R, seed=seed, max_id_bytes=max_id_bytes, _hash_bits=_hash_bits)
        self._guard = self._index._guard  # one lock for the index and the table
        self._python_path_steps = 0

        # host state; the kernels see it through addresses in _ctx, so these
        # arrays must stay referenced (and never be reallocated) while the
        # table lives
        self._state = np.zeros((T.F_NB + ng, R), np.int32)  # [num_fields, max_num_reqs]
        self.block_tables = [np.zeros((R, w), np.int32) for w in widths]  # [max_num_reqs, W_g] per group
        self._bt_addr = np.array([bt.ctypes.data for bt in self.block_tables], np.int64)
        self._bt_w = np.array(widths, np.int64)
        self._flat_bt = np.zeros(ng, np.int64)
        # prediction of each update's rows from the previous one: double
        # buffered, [2, max_num_reqs] (see _kernels.step)
        self._prev_obj = np.zeros((2, R), np.int64)
        self._prev_row = np.full((2, R), -1, np.int32)
        self._row_prev_pos = np.full((2, R), -1, np.int32)
        self._scratch = np.zeros((T.num_scratch_rows(ng), R), np.int32)
        # rows of the last step: cached then new at [0, 2R), freed at [2R, 3R)
        self._res = np.zeros(3 * R, np.int32)
        if decode_query_len is not None:
            decode_query_len = operator.index(decode_query_len)
            if decode_query_len <= 0:
                raise ValueError(f"decode_query_len must be positive, got {decode_query_len}")
        self.decode_query_len = decode_query_len
        nb = R if decode_query_len else 0  # batch arrays only when a batch is built
        self._b = np.zeros((T.B_ROWS, nb), np.int32)  # [B_ROWS, max_num_reqs]
        self._b_idx = np.zeros(nb, np.intp)  # [max_num_reqs]: idx_mapping
        self._b_bool = np.zeros((T.BB_ROWS, nb), np.bool_)  # [BB_ROWS, max_num_reqs]
        self._b_obj = np.zeros((T.BO_ROWS, nb), np.int64)  # [BO_ROWS, max_num_reqs]
        self._mirror = None
        token_ids = None
        host_tokens = True
        if device is not None:
            from mtpstate.mirror import DeviceMirror

            self._mirror = DeviceMirror(self, device, **(mirror_options or {}))
            token_ids = self._mirror.host_token_ids
            host_tokens = self._mirror.keeps_host_token_ids
        if token_ids is None and host_tokens:
            token_ids = np.zeros((R, L), np.int32)
        self.token_ids = token_ids  # [max_num_reqs, max_model_len]; None: the mirror's token target only
        if prefault:
            for a in (self._state, self.token_ids, *self.block_tables, self._scratch):
                if a is not None:
                    a.fill(0)

        c = self._ctx = np.zeros(T.TB_SIZE, np.int64)
        c[T.TB_STATE] = self._state.ctypes.data
        c[T.TB_R] = R
        c[T.TB_STG_STRIDE] = R  # the mirror pads it (aligned device rows)
        c[T.TB_NG] = ng
        c[T.TB_BT_ADDR] = self._bt_addr.ctypes.data
        c[T.TB_BT_W] = self._bt_w.ctypes.data
        c[T.TB_TOK] = 0 if self.token_ids is None else self.token_ids.ctypes.data
        c[T.TB_L] = L
        c[T.TB_PREV_OBJ] = self._prev_obj.ctypes.data
        c[T.TB_PREV_ROW] = self._prev_row.ctypes.data
        c[T.TB_ROW_PREV_POS] = self._row_prev_pos.ctypes.data
        c[T.TB_SCR] = self._scratch.ctypes.data
        c[T.TB_FLAT_BT] = self._flat_bt.ctypes.data
        c[T.TB_FLAT_TOK] = -1
        c[T.TB_RES] = self._res.ctypes.data
        c[T.TB_DQL] = decode_query_len or 0
        c[T.TB_BATCH] = self._b.ctypes.data
        c[T.TB_BATCH_IDX] = self._b_idx.ctypes.data
        c[T.TB_BATCH_BOOL] = self._b_bool.ctypes.data
        c[T.TB_BATCH_OBJ] = self._b_obj.ctypes.data
        c[T.TB_B_N] = -1
        self._b_holder = [[]]  # the kernel puts each step's req_ids list here
        c[T.TB_B_HOLDER] = id(self._b_holder)
        self._new_holder = [None]  # what the kernel read of the step's new requests, until the call returns
        c[T.TB_NEW_HOLDER] = id(self._new_holder)
        c[T.TB_NEW_NAMES] = _NEW_NAMES_ADDR.ctypes.data
        # the same memory as Python ints: what the Python side reads and writes
        # every step (a numpy scalar per access costs several times more)
        cv = self._cv = memoryview(c)
        self._batch = None
        if decode_query_len:
            self._batch = BatchReqState(cv, self._b, self._b_idx, self._b_bool, self._b_holder)
        self._result = StepResult(self._res, cv, R, self._batch)
        # staging slots stay 0 (off, no buffer) unless a device mirror opens a step
        self._ix_addr = self._index._ctx_addr
        self._tb_addr = int(c.ctypes.data)
        if self._mirror is not None:
            self._mirror.attach()

    # -- views of the host state ------------------------------------------

    @property
    def num_computed_tokens(self) -> np.ndarray:
        """[max_num_reqs] int32: overwritten from the scheduler every step."""
        return self._state[T.F_NCT]

    @property
    def num_computed_prefill_tokens(self) -> np.ndarray:
        """[max_num_reqs] int32: ``min(num_computed_tokens, prefill_len)``."""
        return self._state[T.F_NCPT]

    @property
    def prefill_len(self) -> np.ndarray:
        """[max_num_reqs] int32: number of prefill tokens (prompt + output so far when re-sent)."""
        return self._state[T.F_PREFILL]

    @property
    def prompt_len(self) -> np.ndarray:
        """[max_num_reqs] int32."""
        return self._state[T.F_PROMPT]

    @property
    def max_seq_len(self) -> np.ndarray:
        """[max_num_reqs] int32: ``prompt_len + max_tokens``."""
        return self._state[T.F_MAXSEQ]

    @property
    def num_blocks(self) -> np.ndarray:
        """[num_groups, max_num_reqs] int32: blocks in each row of each group's block table."""
        return self._state[T.F_NB :]

    @property
    def index(self) -> RequestIndex:
        """The id -> row index (read it; mutate only through the table)."""
        return self._index

    # -- internals ---------------------------------------------------------

    @staticmethod
    def _read_cached(cached) -> tuple:
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

    def _bind(self, fin, pre, new_reqs, cached, batch) -> _Step:
        """Read the step's inputs once into a _Step (see its docstring).
        ``cached``: the fields from ``_read_cached`` or None; ``batch``:
        (num_scheduled_tokens, scheduled_spec_decode_tokens,
        total_num_scheduled_tokens) or None."""
        b = _Step()
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

    def _describe_new(self, b: _Step) -> None:
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

    def _canonicalize(self, b: _Step) -> None:
        """The generic path: every input as lists of exact str / int (bytes
        for ids with no UTF-8 form), or a StateError naming what is wrong.
        Works on the bound values: nothing is read from the scheduler again."""
        self._python_path_steps += 1
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
        self._describe_new(b)

    def _run_kernel(self, args: tuple) -> int:
        """One launch of the step kernel on its argument tuple, inside a
        staging step of the device mirror when there is one (shipped when the
        kernel accepts the step, closed unshipped otherwise). Returns the
        kernel's status."""
        mirror = self._mirror
        if mirror is not None:
            mirror.begin_step()
        status = tb_apply(self._ix_addr, self._tb_addr, id(args))
        if mirror is not None:
            if status == K.OK:
                cv = self._cv
                mirror.end_step(cv[T.TB_STG_N], cv[T.TB_STG_TOK_N], cv[T.TB_STG_DUPS] != 0)
            else:
                mirror.abort_step()
        return status

    def _check_batch(self) -> None:
        if self._cv[T.TB_B_N] == -2:
            raise MemoryError("mtpstate: no memory for the batch's req_ids list (the step itself was applied)")

    def _launch(self, b: _Step) -> None:
        """Run the step kernel on a bound step; handle the retry statuses
        (the new requests read in Python, grow key storage or staging, the
        generic path); raise on bad input. The caller holds the call guard."""
        if b.new:
            self._describe_new(b)
        canonical = False
        mirror = self._mirror
        ixc = self._index._ctx
        try:
            while True:
                status = self._run_kernel(b.args())
                if status == K.OK:
                    self._check_batch()
                    if b.fin is not None or b.pre is not None or b.new or b.reqs is not None:
                        self._index._maybe_shrink_arena()  # rows were freed
                    return
                if b.reqs is not None:
                    # anything but OK: on from what the kernel read (each
                    # attribute is read once), as descriptors built here
                    self._new_from_held(b, status)
                    if status == K.E_NEW_SLOW or status == K.E_NEW_READ:
                        continue
                if status == K.E_KEY_TOO_LONG:
                    self._index._grow_arena(int(self._ctx[T.TB_ERR_ARG]))
                    continue
                if status == K.E_STAGE_FULL:
                    mirror.grow_staging(int(self._ctx[T.TB_ERR_ARG]))
                    continue
                if status == K.E_NOT_CANONICAL and not canonical:
                    self._canonicalize(b)
                    canonical = True
                    ixc[K.IX_ALLOW_BYTES] = 1
                    continue
                self._raise(status, b)
        finally:
            ixc[K.IX_ALLOW_BYTES] = 0
            self._new_holder[0] = None
            if mirror is not None:
                mirror.abort_step()

    def _new_from_held(self, b: _Step, status: int) -> None:
        """The step's new requests as ``_NewRequest`` descriptors, from what
        the kernel read of them (the holder list) and, past where it
        stopped, read here; raises what reading them raises."""
        held = self._new_holder[0]
        reqs = b.reqs
        b.reqs = None
        if status == K.E_CHANGED and int(self._ctx[T.TB_ERR_PHASE]) == K.PH_NEW:
            raise InvalidStepError("scheduled_new_reqs changed while the step read it")
        stop, failed_slot = len(reqs), -1
        if status == K.E_NEW_READ:
            stop, failed_slot = int(self._ctx[T.TB_ERR_POS]), int(self._ctx[T.TB_ERR_ARG])
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
                new.append(
                    _read_new_request(held[base], k, held[base + 1 : base + failed_slot], held[base + failed_slot])
                )
            else:
                new.append(_read_new_request(r, k))
        b.new = new
        self._describe_new(b)

    def _raise(self, status: int, b: _Step) -> None:
        ctx = self._ctx
        pos, arg = int(ctx[T.TB_ERR_POS]), int(ctx[T.TB_ERR_ARG])
        phase, field = int(ctx[T.TB_ERR_PHASE]), int(ctx[T.TB_ERR_FIELD])
        if phase == K.PH_NEW:
            ids = [r.req_id for r in b.new]
        elif phase == K.PH_BATCH:
            ids = list(b.nst) if b.nst is not None else None
        elif phase == K.PH_SPEC:
            ids = list(b.spec) if b.spec is not None else None
        else:
            ids = {K.PH_FINISH: b.fin, K.PH_PREEMPT: b.pre, K.PH_CACHED: b.cid, K.PH_RESUMED: b.cres}.get(phase)
        rid = key_text(ids[pos]) if (ids is not None and 0 <= pos < len(ids)) else None
        fname = _FIELD_NAMES.get(field, "")
        if phase == K.PH_CACHED and field == K.FLD_BLOCKS:
            fname = "new_block_ids"
        what = _PHASE_NAMES.get(phase, "request")
        who = f"{what} {rid!r}" if rid is not None else f"{what}s"
        at = f"{who}, field {fname}" if fname else who
        L = self.max_model_len
        if status == K.E_UNKNOWN:
            if phase == K.PH_BATCH:
                raise UnknownRequestError(rid, "scheduled (num_scheduled_tokens) but not live after the step")
            raise UnknownRequestError(rid, "finished or preempted in this step" if arg else "not live")
        if status == K.E_CHANGED:
            raise InvalidStepError(f"{_FIELD_NAMES[K.FLD_COUNT]} changed while the step was applied")
        if status == K.E_COUNT_VALUE:
            value = f"={arg}" if arg != -1 else " (out of int64 range)"
            raise InvalidStepError(f"{at}: num_scheduled_tokens{value} outside [0, 2**31)")
        if status == K.E_TOTAL:
            raise InvalidStepError(
                f"total_num_scheduled_tokens={_short(b.total)} but num_scheduled_tokens sum to {arg}"
            )
        if status == K.E_BATCH_SIZE:
            raise InvalidStepError(
                f"num_scheduled_tokens has {arg} entries, more than max_num_reqs={self.max_num_reqs}"
            )
        if status == K.E_DUPLICATE:
            if phase == K.PH_NEW:
                raise DuplicateRequestError(f"new request id {rid!r} appears twice in the step")
            if pos < 0:
                raise DuplicateRequestError(f"{arg} cached requests exceed max_num_reqs={self.max_num_reqs}")
            if phase == K.PH_BATCH:
                raise DuplicateRequestError(f"scheduled request {rid!r} has the row of another scheduled id")
            raise DuplicateRequestError(f"cached request {rid!r} is listed twice in the step")
        if status == K.E_CAPACITY:
            free = self.max_num_reqs - len(self._index)
            raise CapacityError(f"{arg} new requests but only {free} free rows (+ rows freed by this step)")
        if status == K.E_LENGTHS:
            raise InvalidStepError(f"scheduled_cached_reqs: {fname} has {arg} entries, req_ids has {len(b.cid)}")
        if status == K.E_ID_TOO_LONG:
            raise InvalidStepError(
                f"{what} id of {arg} bytes exceeds max_id_bytes={self._index.max_id_bytes}: {_short(rid)}"
            )
        if status == K.E_NCT_RANGE:
            value = f"={arg}" if arg else " (out of int64 range)"
            raise InvalidStepError(f"{at}: num_computed_tokens{value} outside [0, max_model_len={L}]")
        if status == K.E_NEW_NCT_RANGE:
            value = f"={arg}" if arg != -1 else " (out of int64 range)"
            raise InvalidStepError(f"{at}: num_computed_tokens{value} outside [0, prefill length]")
        if status == K.E_TOO_LONG:
            value = f"{arg}" if arg >= 0 else "out of range"
            raise InvalidStepError(f"{at}: length {value} outside [0, max_model_len={L}]")
        if status == K.E_MAX_TOKENS:
            raise InvalidStepError(f"{at}: max_tokens is negative or prompt_len + max_tokens overflows int32")
        if status == K.E_TOKEN_VALUE:
            raise InvalidStepError(f"{at}: token ids must be ints in [0, 2**31) (token #{arg})")
        if status == K.E_GROUPS:
            raise InvalidStepError(f"{at}: block ids for {arg} KV-cache groups, the table has {self.num_groups}")
        if status == K.E_BLOCK_OVERFLOW:
            raise InvalidStepError(
                f"{at}: block table of group {arg} overflows its {self.max_num_blocks_per_group[arg]} blocks"
            )
        if status == K.E_BLOCK_VALUE:
            raise InvalidStepError(f"{at}: block ids of group {arg} must be ints in [0, 2**31)")
        if status == K.E_NOT_CANONICAL:
            raise InvalidStepError(f"{at}: unsupported value")
        raise StateError(f"internal error: kernel status {status} at {at} (position {pos})")  # pragma: no cover

    def _step(self, fin, pre, new_reqs, cached, batch=None) -> StepResult:
        guard = self._guard
        guard.enter()
        try:
            self._launch(self._bind(fin, pre, new_reqs, cached, batch))
        finally:
            guard.exit()
        return self._result

    # -- public API --------------------------------------------------------

    def apply(self, scheduler_output) -> StepResult:
        """Apply one scheduler step: finish, add, update (see docs/api.md),
        and, for a table with ``decode_query_len``, build its batch.

        Validates the whole step: on bad input it raises a
        :class:`~mtpstate.StateError` naming the request and field, and
        changes nothing.

        Returns
        -------
        StepResult
            Rows of the cached, new and freed requests, and the batch
            (views valid until the next call that changes the table).
        """
        guard = self._guard
        lock = guard._lock
        if lock.acquire(False):
            guard._owner = _get_ident()
        else:
            guard.enter()  # another thread: wait; this one (a callback): StateError
        try:
            return self._apply_locked(scheduler_output)
        finally:
            guard._owner = None
            lock.release()

    def _apply_locked(self, so) -> StepResult:
        try:
            fin = so.finished_req_ids
            pre = so.preempted_req_ids
            new = so.scheduled_new_reqs
            cached = so.scheduled_cached_reqs
            batch = None
            if self.decode_query_len is not None:
                nst = getattr(so, "num_scheduled_tokens", None)
                if nst is not None:
                    spec = getattr(so, "scheduled_spec_decode_tokens", None)
                    batch = (nst, spec, getattr(so, "total_num_scheduled_tokens", None))
        except StateError:
            raise
        except Exception as e:
            raise InvalidStepError(f"not a scheduler output: {e!r}") from None
        cfields = self._read_cached(cached)
        cid, cnct, cblk, cres = cfields
        # the steady state of decoding (nothing finished or added, exact
        # lists and dicts): the kernel's arguments straight from the step
        tf, tp, tn = type(fin), type(pre), type(new)
        if (
            (tf is set or tf is frozenset or tf is list or tf is tuple)
            and not fin
            and (pre is None or ((tp is set or tp is frozenset or tp is list or tp is tuple) and not pre))
            and (tn is list or tn is tuple)
            and not new
        ):
            tr = type(cres)
            if (
                type(cid) is list
                and type(cnct) is list
                and type(cblk) is list
                and (cres is None or ((tr is set or tr is frozenset or tr is list or tr is tuple) and not cres))
            ):
                nst = spec = total = None
                exact = True
                if batch is not None:
                    nst, spec, total = batch
                    exact = (
                        type(nst) is dict
                        and (spec is None or type(spec) is dict)
                        and (total is None or type(total) is int)
                    )
                args = (None, None, None, cid, 0, id(cnct), 0, cblk, None, nst, spec, total, None)  # the A_* slots
                if exact:
                    # (no mirror: the kernel alone, the cheapest call at N = 1)
                    status = (
                        tb_apply(self._ix_addr, self._tb_addr, id(args))
                        if self._mirror is None
                        else self._run_kernel(args)
                    )
                    if status == K.OK:
                        if batch is not None:
                            self._check_batch()
                        return self._result
                # anything else: the general handling (the kernel changed nothing)
        self._launch(self._bind(fin, pre, new, cfields, batch))
        return self._result

    def finish(self, req_ids) -> StepResult:
        """Remove these requests (unknown ids are ignored)."""
        return self._step(req_ids, None, None, None)

    def add(self, new_reqs) -> StepResult:
        """Add new requests (objects shaped like vLLM's ``NewRequestData``)."""
        return self._step(None, None, new_reqs, None)

    def update(self, cached_reqs) -> StepResult:
        """Update running requests (shaped like vLLM's ``CachedRequestData``)."""
        return self._step(None, None, None, self._read_cached(cached_reqs))

    @property
    def python_path_steps(self) -> int:
        """Steps that needed the Python conversion path (exotic input types:
        numpy scalars in lists, str subclasses, ids with lone surrogates,
        ...). vLLM-shaped steps never do."""
        return self._python_path_steps

    def update_arrays(self, req_ids, num_computed_tokens, new_block_offsets=None, new_block_ids=None) -> np.ndarray:
        """Update running requests from arrays an engine already holds.

        Parameters
        ----------
        req_ids : sequence of str or np.ndarray of int
            Request ids, or rows (integer array) of live requests.
        num_computed_tokens : array of int, same length
        new_block_offsets : list of arrays, one per group, optional
            CSR offsets ``[n + 1]``: request i's new blocks of group g are
            ``new_block_ids[g][offsets[g][i]:offsets[g][i + 1]]``.
        new_block_ids : list of arrays, one per group, optional

        Returns
        -------
        np.ndarray[int32]
            The rows updated.
        """
        from mtpstate._kernels.arrays import update_from_arrays

        return update_from_arrays(self, req_ids, num_computed_tokens, new_block_offsets, new_block_ids)

    @property
    def max_id_bytes(self) -> int:
        """The longest request id (UTF-8 bytes) a step may add."""
        return self._index.max_id_bytes

    def accepts_request_id(self, req_id) -> bool:
        """Whether a new request with this id can be added (a str of at most
        ``max_id_bytes`` UTF-8 bytes): what an engine checks when it admits a
        request, to reject that one request rather than fail a step."""
        if not isinstance(req_id, str):
            return False
        try:
            n = len(req_id.encode("utf-8"))
        except UnicodeEncodeError:
            n = len(req_id.encode("utf-8", "surrogatepass"))
        return n <= self._index.max_id_bytes

    def rows(self, req_ids) -> np.ndarray:
        """Rows of live ids (:class:`~mtpstate.UnknownRequestError` otherwise)."""
        return self._index.lookup(req_ids)

    def is_prefilling(self, rows) -> np.ndarray:
        """``num_computed_prefill_tokens[rows] < prefill_len[rows]``."""
        rows = np.asarray(rows)
        return self.num_computed_prefill_tokens[rows] < self.prefill_len[rows]

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, req_id) -> bool:
        return req_id in self._index

    def __copy__(self):
        # the kernels address the arrays by pointer: a copy would write into
        # the original's memory
        raise TypeError("RequestTable cannot be copied or pickled; build a new one and replay the steps")

    __deepcopy__ = __reduce_ex__ = lambda self, *a: self.__copy__()  # noqa: E731

    def __del__(self):
        # the kernels hold a reference to each id object of the current
        # prediction buffer (see _kernels.step); give them back. At
        # interpreter exit modules may be half torn down: then do nothing.
        try:
            ctx = self._ctx
            if not ctx[T.TB_PREV_OWNED]:
                return
            cur, n = int(ctx[T.TB_PREV_CUR]), int(ctx[T.TB_PREV_N])
            objs = self._prev_obj[cur, :n].tolist()
            ctx[T.TB_PREV_N] = 0
            ctx[T.TB_PREV_OWNED] = 0
            from mtpstate._kernels.native import py_decref as decref

            for obj in objs:
                if obj:
                    decref(obj)
        except Exception:
            pass

    # -- device mirror -----------------------------------------------------

    def _device_mirror(self):
        if self._mirror is None:
            raise StateError("this table has no device mirror (pass device=...)")
        return self._mirror

    @property
    def device_tensors(self):
        """torch tensors on ``device`` with the host arrays' names and shapes."""
        return self._device_mirror().tensors

    def upload_rows(self, rows, purpose: str = "rows"):
        """Row numbers (e.g. a batch's ``idx_mapping_np``) as an int64 tensor
        on the mirror's device: one non-blocking copy on the current stream
        from a ring of persistent pinned buffers kept per ``purpose`` (no
        pinned allocation per call; each buffer is refilled only after its
        last copy completed). The tensor is valid for ``ring_depth`` calls
        with the same ``purpose``; StateError without a device mirror or for
        more rows than ``max_num_reqs``."""
        return self._device_mirror().upload_rows(np.asarray(rows), purpose)

    def device_idx_mapping(self):
        """The last step's batch ``idx_mapping`` as an int64 tensor on the
        mirror's device, shipped by the step's own device work (mirror
        option ``idx_mapping=True``). Valid for ``ring_depth`` steps;
        StateError without such a mirror or before a step with a batch."""
        m = self._device_mirror()
        if not m._idx_on:
            raise StateError("this table's mirror does not ship idx_mapping (mirror_options={'idx_mapping': True})")
        return m.idx_mapping()

    def synchronize(self) -> None:
        """Wait until every launched copy has landed (a stale mirror is
        resynchronized first: :class:`~mtpstate.MirrorFaultError`)."""
        if self._mirror is not None:
            self._mirror.synchronize()

    def transfer_stats(self) -> dict:
        """``{"bytes": ..., "copies": ..., "path": ...}``: host-to-device
        traffic of the last step (padded to its size bucket), the copies
        that carried it, and how its device work was issued (``"graph"``,
        ``"eager"``, ``"host"``; None: nothing shipped)."""
        if self._mirror is None:
            return {"bytes": 0, "copies": 0, "path": None}
        return self._mirror.stats()

    def __repr__(self) -> str:
        m = self._mirror
        mirror = "" if m is None else f", device={str(m.device)!r}, mirror={m.path!r}"
        if m is not None and m.graph_error:
            mirror += f" ({m.graph_error})"
        return (
            f"RequestTable(max_num_reqs={self.max_num_reqs}, max_model_len={self.max_model_len}, "
            f"block_sizes={list(self.block_sizes)}, live={len(self)}{mirror})"
        )
