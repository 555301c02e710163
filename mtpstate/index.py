"""RequestIndex: request id -> row, with no Python dict.

An open-addressing hash table (linear probing, backward-shift deletion) kept
in numpy arrays and driven by the kernels in ``_kernels.index``. Keys are the ids'
UTF-8 bytes, read in place from the str objects and stored per row, so a row is
only ever returned after comparing the ids themselves (request ids can come
from clients: a crafted hash collision must not hand one request another's
row).
"""

from __future__ import annotations

import operator
import os
import threading
from _thread import get_ident as _get_ident
from collections.abc import Iterable

import numpy as np

from mtpstate._kernels import slots as T
from mtpstate._kernels import status as K
from mtpstate._kernels.cpython import ARRAY_LAYOUT_OK, ASCII_DATA_OFFSET, DICT_LAYOUT_OK, PY_ADDRESSES
from mtpstate._kernels.index import INLINE_BYTES, KEY_WORDS, ix_find, ix_insert, ix_remove
from mtpstate.errors import (
    CapacityError,
    DuplicateRequestError,
    StateError,
    UnknownRequestError,
)

__all__ = ["RequestIndex"]

_HASH_BITS_ALL = (1 << 63) - 1


def _pow2_at_least(n: int) -> int:
    size = 8
    while size < n:
        size *= 2
    return size


def canonical_ids(req_ids, what: str = "request id") -> list:
    """The ids as a list of exact str (bytes for ids with no UTF-8 form), or
    StateError. This is the generic path's conversion; the fast path reads
    lists and tuples of exact str in place."""
    if isinstance(req_ids, (str, bytes)):
        raise StateError(f"expected a sequence of {what}s, got a single {type(req_ids).__name__}")
    if isinstance(req_ids, np.ndarray):
        req_ids = req_ids.tolist()
    out = []
    for x in req_ids:
        if not isinstance(x, str):
            raise StateError(f"{what} must be str, got {type(x).__name__} {x!r}")
        s = str.__str__(x)
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            # lone surrogates: key on their surrogatepass bytes
            out.append(s.encode("utf-8", "surrogatepass"))
            continue
        out.append(s)
    return out


def key_text(key) -> str:
    return key.decode("utf-8", "surrogatepass") if isinstance(key, bytes) else key


class _CallGuard:
    """Serializes the calls that run kernels on one index (and its table):
    another thread waits; a call made from inside a call (a callback of the
    caller's objects re-entering) raises instead of deadlocking or
    interleaving with the call it interrupted."""

    __slots__ = ("_lock", "_owner")

    def __init__(self):
        self._lock = threading.Lock()
        self._owner = None

    def enter(self) -> None:
        me = _get_ident()
        if not self._lock.acquire(False):
            if self._owner == me:
                raise StateError("re-entrant call: this table (or index) is already in a call on this thread")
            self._lock.acquire()
        self._owner = me

    def exit(self) -> None:
        self._owner = None
        self._lock.release()


class RequestIndex:
    """Map str request ids to rows ``0..capacity-1``; every call is batched.

    Rows are assigned lowest-free-first, so processes fed the same sequence of
    calls (tensor-parallel ranks) assign the same rows whatever their
    ``PYTHONHASHSEED``. A call that raises :class:`~mtpstate.StateError`
    leaves the index exactly as it was.

    Parameters
    ----------
    capacity : int
        Number of rows.
    seed : int, optional
        Seed of the key hash. Rows never depend on it; a random seed (the
        default) makes the probe sequence unpredictable to clients that pick
        their own request ids.
    max_id_bytes : int
        Longest id accepted, in UTF-8 bytes (default 65536). Ids of up to 56
        bytes are stored in the row; longer ones in an arena whose size
        follows the bytes of the live long ids (compacted, and returned, as
        they finish). A longer id is refused on insert and is never live.
    """

    def __init__(self, capacity: int, *, seed: int | None = None, max_id_bytes: int = 65536, _hash_bits: int = 63):
        capacity = operator.index(capacity)
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if not 0 <= _hash_bits <= 63:
            raise ValueError("_hash_bits must be in [0, 63]")
        max_id_bytes = operator.index(max_id_bytes)
        if max_id_bytes <= 0:
            raise ValueError(f"max_id_bytes must be positive, got {max_id_bytes}")
        self.max_id_bytes = max_id_bytes
        self._guard = _CallGuard()
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") & _HASH_BITS_ALL
        self._capacity = capacity
        tsize = _pow2_at_least(2 * capacity)
        # the kernels see these arrays only through their addresses in _ctx:
        # they must stay referenced here for as long as the index lives
        self._slots = np.full(tsize, -1, np.int64)  # [table_size]
        self._row_hash = np.zeros(capacity, np.uint64)  # [capacity]
        self._key_words = KEY_WORDS  # a length word, then 56 bytes of id (or an arena address + 48)
        self._keys = np.zeros(capacity * self._key_words, np.uint64)  # [capacity * KEY_WORDS]
        self._arena = np.zeros(0, np.uint64)  # [arena words]: the long ids' bytes
        self._key_len = np.full(capacity, -1, np.int32)  # [capacity]
        self._ctx = np.zeros(T.IX_SIZE, np.int64)
        c = self._ctx
        c[T.IX_SLOTS] = self._slots.ctypes.data
        c[T.IX_MASK] = tsize - 1
        c[T.IX_ROW_HASH] = self._row_hash.ctypes.data
        c[T.IX_KEYS] = self._keys.ctypes.data
        c[T.IX_KW] = self._key_words
        c[T.IX_KEY_LEN] = self._key_len.ctypes.data
        c[T.IX_CAP] = capacity
        c[T.IX_SEED] = seed & _HASH_BITS_ALL
        c[T.IX_HMASK] = (1 << _hash_bits) - 1
        c[T.IX_T_LIST : T.IX_FALSE + 1] = PY_ADDRESSES[:8]
        c[T.IX_T_DICT] = PY_ADDRESSES[8]
        c[T.IX_DICT_OK] = DICT_LAYOUT_OK
        c[T.IX_ASCII_OFF] = ASCII_DATA_OFFSET
        c[T.IX_MAX_KEY] = max_id_bytes
        c[T.IX_ARRAY_OK] = int(ARRAY_LAYOUT_OK)
        c[T.IX_ARENA] = self._arena.ctypes.data
        self._ctx_addr = int(c.ctypes.data)

    # -- internals -------------------------------------------------------

    _ARENA_MIN_WORDS = 1024  # 8 KiB

    def _grow_arena(self, short_words: int) -> None:
        """Make room for ``short_words`` more arena words than the arena has
        left: compact the live long ids into a new arena of twice what they
        and the new ones need."""
        c = self._ctx
        self._compact_arena(int(c[T.IX_ARENA_LIVE]) + int(c[T.IX_ARENA_CAP]) - int(c[T.IX_ARENA_TOP]) + short_words)

    def _maybe_shrink_arena(self) -> None:
        """Return the memory of finished long ids once their garbage exceeds
        what is live (called after calls that may have freed rows)."""
        c = self._ctx
        top, live = int(c[T.IX_ARENA_TOP]), int(c[T.IX_ARENA_LIVE])
        if top - live > max(live, self._ARENA_MIN_WORDS):
            self._compact_arena(live)

    def _compact_arena(self, need_words: int) -> None:
        c = self._ctx
        kw = self._key_words
        keys = self._keys.reshape(self._capacity, kw)
        rows = np.flatnonzero(self._key_len > INLINE_BYTES)
        nw = (self._key_len[rows].astype(np.int64) + 7) // 8
        live = int(nw.sum())
        cap = max(self._ARENA_MIN_WORDS, 2 * max(need_words, live))
        arena = np.zeros(cap, np.uint64)
        if live:
            src = (keys[rows, 1].astype(np.int64) - self._arena.ctypes.data) // 8
            starts = np.concatenate(([0], np.cumsum(nw)[:-1]))
            arena[:live] = self._arena[np.repeat(src - starts, nw) + np.arange(live)]
            keys[rows, 1] = (arena.ctypes.data + 8 * starts).astype(np.uint64)
        self._arena = arena
        c[T.IX_ARENA] = arena.ctypes.data
        c[T.IX_ARENA_CAP] = cap
        c[T.IX_ARENA_TOP] = live
        c[T.IX_ARENA_LIVE] = live

    def key_bytes(self) -> int:
        """Bytes of key storage: the rows' inline keys and the arena."""
        return self._keys.nbytes + self._arena.nbytes

    def _run(self, kernel, ids, *args):
        """Launch ``kernel`` on ``ids``; on a type it does not take, retry once
        on the canonical form (the generic path)."""
        self._guard.enter()
        try:
            return self._run_locked(kernel, ids, *args)
        finally:
            self._guard.exit()

    def _run_locked(self, kernel, ids, *args):
        canonical = False
        try:
            while True:
                status = kernel(self._ctx_addr, id(ids), *args)
                if status == K.OK:
                    return ids
                if status == K.E_KEY_TOO_LONG:
                    self._grow_arena(int(self._ctx[T.IX_ERR_ARG]))
                elif status == K.E_NOT_CANONICAL and not canonical:
                    ids = canonical_ids(ids)
                    canonical = True
                    self._ctx[T.IX_ALLOW_BYTES] = 1
                else:
                    self._raise(status, ids)
        finally:
            self._ctx[T.IX_ALLOW_BYTES] = 0

    def _raise(self, status: int, ids) -> None:
        pos = int(self._ctx[T.IX_ERR_POS])
        arg = int(self._ctx[T.IX_ERR_ARG])
        rid = key_text(ids[pos]) if pos >= 0 else None
        if status == K.E_UNKNOWN:
            raise UnknownRequestError(rid)
        if status == K.E_LIVE:
            row = np.empty(1, np.int32)
            self._run_locked(ix_find, [ids[pos]], row, False)  # (the caller holds the guard)
            raise DuplicateRequestError(f"request id {rid!r} is already live (row {row[0]})")
        if status == K.E_DUPLICATE:
            raise DuplicateRequestError(f"request id {rid!r} appears twice in the batch (positions {arg} and {pos})")
        if status == K.E_ID_TOO_LONG:
            raise StateError(f"request id of {arg} bytes exceeds max_id_bytes={self.max_id_bytes}: {rid[:40]!r}...")
        if status == K.E_CAPACITY:
            raise CapacityError(
                f"cannot insert {arg} ids: only {self._capacity - len(self)} of {self._capacity} rows are free"
            )
        raise StateError(f"internal error: kernel status {status} at position {pos}")  # pragma: no cover

    @staticmethod
    def _as_list(req_ids):
        if type(req_ids) is list or type(req_ids) is tuple:
            return req_ids
        if isinstance(req_ids, (str, bytes)):
            raise StateError(f"expected a sequence of request ids, got a single {type(req_ids).__name__}")
        if isinstance(req_ids, Iterable):
            return list(req_ids)
        raise StateError(f"expected a sequence of request ids, got {type(req_ids).__name__}")

    # -- public API ------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Number of rows."""
        return self._capacity

    def __len__(self) -> int:
        return int(self._ctx[T.IX_NUM_LIVE])

    def __contains__(self, req_id) -> bool:
        if not isinstance(req_id, str):
            return False
        return bool(self.find((req_id,))[0] >= 0)

    def insert(self, req_ids) -> np.ndarray:
        """Insert ids at the lowest free rows, in input order.

        Returns
        -------
        np.ndarray[int32]
            The rows assigned, in input order.

        Raises
        ------
        DuplicateRequestError
            An id is already live, or appears twice in ``req_ids``.
        CapacityError
            More ids than free rows.
        StateError
            A non-str id.
        """
        req_ids = self._as_list(req_ids)
        out = np.empty(len(req_ids), np.int32)
        self._run(ix_insert, req_ids, out)
        return out

    def lookup(self, req_ids) -> np.ndarray:
        """Rows of live ids; :class:`~mtpstate.UnknownRequestError` names the
        first id that is not live."""
        if type(req_ids) is not list and type(req_ids) is not tuple:
            req_ids = self._as_list(req_ids)
        out = np.empty(len(req_ids), np.int32)
        # the common case first: one kernel call, no retry machinery
        guard = self._guard
        guard.enter()
        try:
            if ix_find(self._ctx_addr, id(req_ids), out, True) == K.OK:
                return out
            self._run_locked(ix_find, req_ids, out, True)
        finally:
            guard.exit()
        return out

    def find(self, req_ids) -> np.ndarray:
        """Rows of ids, -1 for ids that are not live."""
        req_ids = self._as_list(req_ids)
        out = np.empty(len(req_ids), np.int32)
        self._run(ix_find, req_ids, out, False)
        return out

    def remove(self, req_ids) -> np.ndarray:
        """Remove ids; returns the rows freed, -1 for ids that were not live
        (ignored, as an engine sees aborts of requests it never scheduled)."""
        req_ids = self._as_list(req_ids)
        out = np.empty(len(req_ids), np.int32)
        self._run(ix_remove, req_ids, out)
        self._maybe_shrink_arena()
        return out

    def req_id(self, row: int) -> str | None:
        """The id living in ``row``, or None if the row is free."""
        row = operator.index(row)
        if not 0 <= row < self._capacity:
            raise StateError(f"row {row} out of range [0, {self._capacity})")
        n = int(self._key_len[row])
        if n < 0:
            return None
        kw = self._key_words
        if n <= INLINE_BYTES:
            raw = self._keys[row * kw + 1 : (row + 1) * kw].tobytes()[:n]
        else:
            off = (int(self._keys[row * kw + 1]) - self._arena.ctypes.data) // 8
            raw = self._arena[off : off + (n + 7) // 8].tobytes()[:n]
        return raw.decode("utf-8", "surrogatepass")

    def live_rows(self) -> np.ndarray:
        """Rows in use, ascending."""
        return np.flatnonzero(self._key_len >= 0).astype(np.int32)

    def __repr__(self) -> str:
        return f"RequestIndex(capacity={self._capacity}, live={len(self)})"

    def __copy__(self):
        # the kernels address the arrays by pointer: a copy would write into
        # the original's memory
        raise TypeError("RequestIndex cannot be copied or pickled; build a new one and insert the ids")

    __deepcopy__ = __reduce_ex__ = lambda self, *a: self.__copy__()  # noqa: E731
