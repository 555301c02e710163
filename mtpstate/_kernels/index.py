"""The request-id -> row hash index: open addressing with linear probing,
a row's key bytes stored with it (compared in full before a row is
returned), backward-shift deletion, an arena for long keys; the entry
kernels ``ix_*`` behind ``mtpstate.index.RequestIndex``.

Private. The Python API (``index.py``, ``table.py``) launches these with
integer arguments only: addresses of Python objects (``id(obj)``, kept alive by
the caller) and of "context" arrays that hold the addresses and sizes of the
state arrays. A numba dispatch costs ~100 ns per array argument and far less
per int, and a step must cost about a microsecond at N = 1.

Every kernel validates its whole input first (pass 1, reading only) and
mutates only if everything is valid (pass 2), so a rejected call changes
nothing. Errors come back as a status code; the detail (position, argument)
is left in the context array for the Python side to turn into a message.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import fmix, load_u8, load_u64, mix, view_i32, view_i64, view_u64
from mtpstate._kernels.pyobjects import _item, _key_of, _pytypes, _seq
from mtpstate._kernels.slots import (
    IX_ALLOW_BYTES,
    IX_ARENA,
    IX_ARENA_CAP,
    IX_ARENA_LIVE,
    IX_ARENA_TOP,
    IX_CAP,
    IX_ERR_ARG,
    IX_ERR_PHASE,
    IX_ERR_POS,
    IX_FREE_HINT,
    IX_HMASK,
    IX_KEY_LEN,
    IX_KEYS,
    IX_KW,
    IX_MASK,
    IX_MAX_KEY,
    IX_NUM_LIVE,
    IX_ROW_HASH,
    IX_SEED,
    IX_SIZE,
    IX_SLOTS,
)
from mtpstate._kernels.status import (
    E_CAPACITY,
    E_DUPLICATE,
    E_ID_TOO_LONG,
    E_KEY_TOO_LONG,
    E_LIVE,
    E_NOT_CANONICAL,
    E_UNKNOWN,
    OK,
)

# a row's key: [length, 7 words of bytes] inline; a longer key keeps
# [length, its address in the arena, its first 6 words] inline
KEY_WORDS = 8
INLINE_BYTES = 8 * (KEY_WORDS - 1)


@jit(signature="int64(int64[::1], int64, int64, int64, int64)")
def _set_err(ctx, code, pos, arg, phase):
    ctx[IX_ERR_POS] = pos
    ctx[IX_ERR_ARG] = arg
    ctx[IX_ERR_PHASE] = phase
    return code


@jit(inline="always")
def _key_tail(ptr, n):
    """The last, partial 8-byte word of a key (n % 8 != 0), zero padded."""
    off = n & ~7
    rem = n - off
    if ((ptr + off) & 4095) <= 4088:
        # a full 8-byte load that stays inside the page of valid bytes cannot
        # fault; the bytes past the key are masked off
        return load_u64(ptr + off) & ((np.uint64(1) << np.uint64(8 * rem)) - np.uint64(1))
    w = np.uint64(0)
    for b in range(rem):
        w |= load_u8(ptr + off + b) << np.uint64(8 * b)
    return w


@jit
def _key_word(ptr, n, i):
    """The i-th 8-byte little-endian word of the key, zero padded."""
    if i * 8 + 8 <= n:
        return load_u64(ptr + i * 8)
    return _key_tail(ptr, n)


@jit
def _hash_key(ptr, n, seed, hmask):
    h = np.uint64(seed) ^ (np.uint64(n) * np.uint64(0x100000001B3))
    nfull = n >> 3
    for i in range(nfull):
        h = mix(h, load_u64(ptr + 8 * i))
    if n & 7:
        h = mix(h, _key_tail(ptr, n))
    return fmix(h) & np.uint64(hmask)


@jit
def _raw_equal(p1, n1, p2, n2):
    if n1 != n2:
        return False
    for i in range((n1 + 7) // 8):
        if _key_word(p1, n1, i) != _key_word(p2, n2, i):
            return False
    return True


@jit
def _ix_arrays(ctx):
    cap = ctx[IX_CAP]
    kw = ctx[IX_KW]
    slots = view_i64(ctx[IX_SLOTS], ctx[IX_MASK] + 1)
    row_hash = view_u64(ctx[IX_ROW_HASH], cap)
    keys = view_u64(ctx[IX_KEYS], cap * kw)
    key_len = view_i32(ctx[IX_KEY_LEN], cap)
    return slots, row_hash, keys, key_len


@jit
def _slot_entry(h, row):
    # slot entry: 31 high hash bits as a tag, then the row; -1 = empty
    return (np.int64(h >> np.uint64(33)) << 32) | np.int64(row)


@jit
def _key_matches_row(keys, kw, r, ptr, n):
    # keys row layout: [length, word 0, word 1, ...], one row per request;
    # a long key: [length, arena address, words 0..5], all its words in the arena
    base = np.int64(r) * kw
    if keys[base] != np.uint64(n):
        return False
    nfull = n >> 3
    if n <= INLINE_BYTES:
        for i in range(nfull):
            if keys[base + 1 + i] != load_u64(ptr + 8 * i):
                return False
        if n & 7:
            return keys[base + 1 + nfull] == _key_tail(ptr, n)
        return True
    for i in range(KEY_WORDS - 2):  # the inline prefix rejects most others
        if keys[base + 2 + i] != load_u64(ptr + 8 * i):
            return False
    addr = np.int64(keys[base + 1])
    for i in range(KEY_WORDS - 2, nfull):
        if load_u64(addr + 8 * i) != load_u64(ptr + 8 * i):
            return False
    if n & 7:
        return load_u64(addr + 8 * nfull) == _key_tail(ptr, n)
    return True


@jit
def key_arena_words(n):
    """Arena words a key of n bytes takes (0: it fits inline)."""
    return 0 if n <= INLINE_BYTES else (n + 7) // 8


@jit
def _ix_params(ctx):
    """(mask, key_words, seed, hash mask, allow_bytes) of an index context."""
    return ctx[IX_MASK], ctx[IX_KW], ctx[IX_SEED], ctx[IX_HMASK], ctx[IX_ALLOW_BYTES]


@jit
def _probe(slots, mask, keys, kw, h, ptr, n):
    """Row of the key, or -1. Rows are told apart by comparing the keys
    themselves, never by hash alone."""
    s = np.int64(h & np.uint64(mask))
    tag = np.int64(h >> np.uint64(33))
    while True:
        e = slots[s]
        if e < 0:
            return -1
        if (e >> 32) == tag:
            r = e & 0xFFFFFFFF
            if _key_matches_row(keys, kw, r, ptr, n):
                return r
        s = (s + 1) & mask


@jit
def _slot_insert(slots, mask, h, row):
    s = np.int64(h & np.uint64(mask))
    while slots[s] >= 0:
        s = (s + 1) & mask
    slots[s] = _slot_entry(h, row)


@jit
def _write_key(ctx, keys, kw, key_len, row_hash, row, ptr, n, h):
    """Store the key of ``row``; a long one also in the arena, which the
    caller checked has room (``_arena_short``)."""
    base = np.int64(row) * kw
    keys[base] = n
    nw = (n + 7) // 8
    if n <= INLINE_BYTES:
        for i in range(nw):
            keys[base + 1 + i] = _key_word(ptr, n, i)
        for i in range(nw + 1, kw):
            keys[base + i] = 0
    else:
        addr = ctx[IX_ARENA] + 8 * ctx[IX_ARENA_TOP]
        ctx[IX_ARENA_TOP] += nw
        ctx[IX_ARENA_LIVE] += nw
        a = view_u64(addr, nw)
        for i in range(nw):
            a[i] = _key_word(ptr, n, i)
        keys[base + 1] = np.uint64(addr)
        for i in range(KEY_WORDS - 2):
            keys[base + 2 + i] = a[i]
    key_len[row] = n
    row_hash[row] = h


@jit(signature="int64(int64[::1], int64[::1], int64)")
def _arena_short(ctx, lens, n):
    """Arena words missing for n more keys of ``lens[:n]`` bytes (0: room
    enough)."""
    need = 0
    for i in range(n):
        need += key_arena_words(lens[i])
    return max(0, ctx[IX_ARENA_TOP] + need - ctx[IX_ARENA_CAP])


@jit
def _slot_remove_row(slots, mask, row_hash, row):
    """Remove ``row`` from the table by backward-shift deletion: no
    tombstones, so lookups do not slow down over insert/remove cycles."""
    i = np.int64(row_hash[row] & np.uint64(mask))
    while (slots[i] & 0xFFFFFFFF) != row or slots[i] < 0:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        e = slots[j]
        if e < 0:
            break
        k = np.int64(row_hash[e & 0xFFFFFFFF] & np.uint64(mask))
        # r may move back into the hole at i unless its home k lies
        # cyclically in (i, j]
        if i <= j:
            stays = i < k <= j
        else:
            stays = k > i or k <= j
        if not stays:
            slots[i] = e
            i = j
    slots[i] = -1


@jit
def _ix_free_row(ctx, slots, row_hash, key_len, row):
    _slot_remove_row(slots, ctx[IX_MASK], row_hash, row)
    n = key_len[row]
    if n > INLINE_BYTES:
        ctx[IX_ARENA_LIVE] -= (n + 7) // 8  # (its words are garbage until compaction)
    key_len[row] = -1
    ctx[IX_NUM_LIVE] -= 1
    if row < ctx[IX_FREE_HINT]:
        ctx[IX_FREE_HINT] = row


@jit
def _ix_commit(ctx, freed, rows, ptrs, lens, hashes):
    """A step's pass 2 in the index: free the rows ``freed`` (in that order),
    then store new key i (``ptrs``, ``lens``, ``hashes``) at ``rows[i]``.
    The step checked the arena has room (``_arena_short``)."""
    slots, row_hash, keys, key_len = _ix_arrays(ctx)
    mask, kw = ctx[IX_MASK], ctx[IX_KW]
    for f in range(freed.shape[0]):
        _ix_free_row(ctx, slots, row_hash, key_len, freed[f])
    n = rows.shape[0]
    for i in range(n):
        _write_key(ctx, keys, kw, key_len, row_hash, rows[i], ptrs[i], lens[i], hashes[i])
        _slot_insert(slots, mask, hashes[i], rows[i])
    ctx[IX_NUM_LIVE] += n


# ----------------------------------------------------------------------------
# RequestIndex kernels


@jit
def ix_find(ctx_addr, ids, out, strict):
    """Rows of ``ids`` into ``out``; -1 for unknown (or E_UNKNOWN if strict)."""
    ctx = view_i64(ctx_addr, IX_SIZE)
    slots, row_hash, keys, key_len = _ix_arrays(ctx)
    mask, kw, seed, hmask, allow = _ix_params(ctx)
    tp = _pytypes(ctx)
    items, n, ok = _seq(ids, tp)
    if not ok:
        return _set_err(ctx, E_NOT_CANONICAL, -1, 0, 0)
    for i in range(n):
        ptr, klen, st = _key_of(_item(items, i), allow, tp)
        if st != OK:
            return _set_err(ctx, st, i, 0, 0)
        r = -1
        if klen <= ctx[IX_MAX_KEY]:  # (longer ids are never live)
            h = _hash_key(ptr, klen, seed, hmask)
            r = _probe(slots, mask, keys, kw, h, ptr, klen)
        if r < 0 and strict:
            return _set_err(ctx, E_UNKNOWN, i, 0, 0)
        out[i] = r
    return OK


@jit
def ix_insert(ctx_addr, ids, out):
    """Insert ``ids`` at the lowest free rows, in order; rows into ``out``."""
    ctx = view_i64(ctx_addr, IX_SIZE)
    slots, row_hash, keys, key_len = _ix_arrays(ctx)
    mask, kw, seed, hmask, allow = _ix_params(ctx)
    cap = ctx[IX_CAP]
    tp = _pytypes(ctx)
    items, n, ok = _seq(ids, tp)
    if not ok:
        return _set_err(ctx, E_NOT_CANONICAL, -1, 0, 0)
    if n > cap - ctx[IX_NUM_LIVE]:
        return _set_err(ctx, E_CAPACITY, -1, n, 0)
    ptrs = np.empty(n, np.int64)
    lens = np.empty(n, np.int64)
    hashes = np.empty(n, np.uint64)
    tsize = 8
    while tsize < 2 * n:
        tsize *= 2
    batch = np.full(tsize, -1, np.int64)  # duplicate detection within the batch
    for i in range(n):
        ptr, klen, st = _key_of(_item(items, i), allow, tp)
        if st != OK:
            return _set_err(ctx, st, i, 0, 0)
        if klen > ctx[IX_MAX_KEY]:
            return _set_err(ctx, E_ID_TOO_LONG, i, klen, 0)
        h = _hash_key(ptr, klen, seed, hmask)
        if _probe(slots, mask, keys, kw, h, ptr, klen) >= 0:
            return _set_err(ctx, E_LIVE, i, 0, 0)
        s = np.int64(h & np.uint64(tsize - 1))
        while batch[s] >= 0:
            j = batch[s]
            if hashes[j] == h and _raw_equal(ptrs[j], lens[j], ptr, klen):
                return _set_err(ctx, E_DUPLICATE, i, j, 0)
            s = (s + 1) & (tsize - 1)
        batch[s] = i
        ptrs[i] = ptr
        lens[i] = klen
        hashes[i] = h
    # growing the arena is asked for only once all else is valid
    short = _arena_short(ctx, lens, n)
    if short > 0:
        return _set_err(ctx, E_KEY_TOO_LONG, -1, short, 0)
    cursor = ctx[IX_FREE_HINT]
    for i in range(n):
        while key_len[cursor] >= 0:
            cursor += 1
        _write_key(ctx, keys, kw, key_len, row_hash, cursor, ptrs[i], lens[i], hashes[i])
        _slot_insert(slots, mask, hashes[i], cursor)
        out[i] = cursor
        cursor += 1
    ctx[IX_FREE_HINT] = cursor
    ctx[IX_NUM_LIVE] += n
    return OK


@jit
def ix_remove(ctx_addr, ids, out):
    """Remove live ``ids``; freed rows into ``out`` (-1: was not live)."""
    ctx = view_i64(ctx_addr, IX_SIZE)
    st = ix_find(ctx_addr, ids, out, False)
    if st != OK:
        return st
    slots, row_hash, keys, key_len = _ix_arrays(ctx)
    n = out.shape[0]
    for i in range(n):
        r = out[i]
        if r >= 0:
            if key_len[r] < 0:  # the same id earlier in this batch
                out[i] = -1
            else:
                _ix_free_row(ctx, slots, row_hash, key_len, r)
    return OK


@jit
def ix_rehash(ctx_addr):
    """Rebuild the slot table from the live rows (after a resize)."""
    ctx = view_i64(ctx_addr, IX_SIZE)
    slots, row_hash, keys, key_len = _ix_arrays(ctx)
    slots[:] = -1
    for r in range(ctx[IX_CAP]):
        if key_len[r] >= 0:
            _slot_insert(slots, ctx[IX_MASK], row_hash[r], r)
