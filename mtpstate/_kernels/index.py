"""numba kernels of the request-id -> row hash index, and the primitives on
ids, ints and lists the step kernels share (status codes, phases, fields).

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

from mtpstate._kernels.native import (
    OFF_ITEMS,
    OFF_SIZE,
    OFF_TYPE,
    STR_STATE_OFFSET,
    bytes_data,
    fmix,
    int_value,
    jit,
    ld64,
    load_i32,
    load_i64,
    load_u8,
    load_u32,
    load_u64,
    mix,
    str_utf8,
    view_i32,
    view_i64,
    view_u64,
)

# ----------------------------------------------------------------------------
# status codes

OK = 0
E_NOT_CANONICAL = 1  # a type the fast path does not take: normalize in Python, retry
E_KEY_TOO_LONG = 2  # the key arena is too small for this call's long ids: grow it in Python, retry
E_STAGE_FULL = 3  # staging buffer too small: grow in Python, retry
E_NOT_STR = 4
E_UNKNOWN = 5
E_DUPLICATE = 6
E_LIVE = 7
E_CAPACITY = 8
E_NCT_RANGE = 9
E_NEW_NCT_RANGE = 10
E_TOO_LONG = 11
E_GROUPS = 12
E_BLOCK_OVERFLOW = 13
E_BLOCK_VALUE = 14
E_TOKEN_VALUE = 15
E_MAX_TOKENS = 16
E_LENGTHS = 17
E_INT_RANGE = 18  # an int outside int64 (or outside what its field allows)
E_ID_TOO_LONG = 19  # a request id longer than max_id_bytes
E_CHANGED = 20  # a dict's item count disagrees with its items (defensive: the GIL is held)
E_COUNT_VALUE = 21  # a scheduled-token count outside [0, 2**31)
E_TOTAL = 22  # total_num_scheduled_tokens differs from the sum of the counts
E_BATCH_SIZE = 23  # more scheduled requests than rows
E_NEW_SLOW = 24  # a new request's attribute of a type not read in place: read the new requests in Python, retry
E_NEW_READ = 25  # reading a new request's attribute raised (the exception is in the holder list)

# phases, reported in the error context: which input the failing item is in
PH_FINISH = 0  # finished_req_ids
PH_NEW = 1  # scheduled_new_reqs
PH_CACHED = 2  # scheduled_cached_reqs
PH_PREEMPT = 3  # preempted_req_ids
PH_RESUMED = 4  # scheduled_cached_reqs.resumed_req_ids
PH_BATCH = 5  # num_scheduled_tokens
PH_SPEC = 6  # scheduled_spec_decode_tokens

# fields, reported in the error context: which attribute of the item
FLD_NONE = 0
FLD_REQ_ID = 1
FLD_PROMPT_LEN = 2
FLD_TOKENS = 3  # prefill_token_ids
FLD_NCT = 4  # num_computed_tokens
FLD_MAX_TOKENS = 5
FLD_BLOCKS = 6  # block_ids / new_block_ids
FLD_COUNT = 7  # the value of a num_scheduled_tokens entry
FLD_DRAFTS = 8  # the value of a scheduled_spec_decode_tokens entry
FLD_TOTAL = 9  # total_num_scheduled_tokens

# kinds of int vectors the kernels read in place (token ids, counts)
V_OBJ = 0  # an exact list or tuple of exact ints: addr is the object
V_ARRAY = 1  # an array.array (or subclass): addr is the object, layout read at kernel time
V_I32 = 2  # raw C-contiguous buffers: addr is the data, length given
V_I64 = 3
V_U32 = 4
V_U64 = 5

INT32_MAX = 2147483647

# ----------------------------------------------------------------------------
# index context: int64 array, one named slot each

IX_SLOTS = 0  # addr int64[table_size]: (hash tag << 32 | row) per slot, -1 empty
IX_MASK = 1  # table_size - 1
IX_ROW_HASH = 2  # addr uint64[capacity]
IX_KEYS = 3  # addr uint64[capacity * KEY_WORDS]: per row [length, UTF-8 bytes zero padded] (see _key_matches_row)
IX_KW = 4  # KEY_WORDS
IX_KEY_LEN = 5  # addr int32[capacity]: key length, -1 = free row
IX_CAP = 6
IX_NUM_LIVE = 7
IX_FREE_HINT = 8  # every row below it is live
IX_SEED = 9
IX_HMASK = 10  # hash bits kept (tests force collisions with a small mask)
IX_ALLOW_BYTES = 11  # set by the generic path for ids without a UTF-8 form
IX_ERR_POS = 12
IX_ERR_ARG = 13
IX_ERR_PHASE = 14
# Addresses of the builtin types and singletons. They change from process to
# process (ASLR), so they are read at run time, never frozen into the cached
# machine code as constants.
IX_T_LIST = 15
IX_T_TUPLE = 16
IX_T_STR = 17
IX_T_BYTES = 18
IX_T_INT = 19
IX_NONE = 20
IX_TRUE = 21
IX_FALSE = 22
IX_ASCII_OFF = 23  # data offset of compact ASCII str objects, 0 = read them through the C API
IX_MAX_KEY = 24  # max_id_bytes: longer ids are refused (new) or cannot be live (lookups)
IX_ARRAY_OK = 25  # 1: array.array's object layout was verified at import (ob_item, ob_descr)
IX_T_DICT = 26
IX_DICT_OK = 27  # 1: dict entries are read in place (layout verified at import), 0: PyDict_Next
# the arena of long keys (longer than INLINE_BYTES): uint64 words, bump
# allocated; a row's words stay until the Python side compacts the arena
IX_ARENA = 28  # addr uint64[IX_ARENA_CAP]
IX_ARENA_CAP = 29
IX_ARENA_TOP = 30  # words allocated so far
IX_ARENA_LIVE = 31  # words of live keys
IX_SIZE = 32

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


@jit
def _pytypes(ctx):
    return (
        ctx[IX_T_LIST],
        ctx[IX_T_TUPLE],
        ctx[IX_T_STR],
        ctx[IX_T_BYTES],
        ctx[IX_T_INT],
        ctx[IX_NONE],
        ctx[IX_TRUE],
        ctx[IX_FALSE],
        ctx[IX_ASCII_OFF],
        ctx[IX_T_DICT],
    )


@jit
def _key_of(obj, allow_bytes, tp):
    """(UTF-8 address, length, status) of a request id object."""
    t = load_i64(obj + OFF_TYPE)
    if t == tp[2]:
        if tp[8] != 0 and (load_u32(obj + STR_STATE_OFFSET) & np.uint64(0x60)) == np.uint64(0x60):
            # compact ASCII: the bytes follow the header, no call needed
            return obj + tp[8], load_i64(obj + OFF_SIZE), OK
        ptr, n = str_utf8(obj)
        if ptr == 0:
            return 0, 0, E_NOT_CANONICAL
        return ptr, n, OK
    if allow_bytes != 0 and t == tp[3]:
        return bytes_data(obj), load_i64(obj + OFF_SIZE), OK
    return 0, 0, E_NOT_CANONICAL


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


@jit(signature="Tuple((int64, int64, boolean))(int64, UniTuple(int64, 10))")
def _seq(obj, tp):
    """(item pointer array, length, ok) of an exact list or tuple."""
    t = load_i64(obj + OFF_TYPE)
    if t == tp[0]:
        return load_i64(obj + OFF_ITEMS), load_i64(obj + OFF_SIZE), True
    if t == tp[1]:
        return obj + OFF_ITEMS, load_i64(obj + OFF_SIZE), True
    return 0, 0, False


# the i-th object address of an item pointer array (a list's ob_item, a tuple's
# inline items): an intrinsic, so the 30-odd call sites cost no inlining pass
_item = ld64


@jit
def _int_of(obj, tp):
    """(value, status) of an exact int; E_INT_RANGE outside int64,
    E_NOT_CANONICAL for anything that is not an exact int."""
    if load_i64(obj + OFF_TYPE) != tp[4]:
        return 0, E_NOT_CANONICAL
    v, ok = int_value(obj)
    if not ok:
        return 0, E_INT_RANGE
    return v, OK


@jit
def _vec(kind, addr, n, tp, array_ok):
    """(kind, base, length, status) of an int vector given as (kind, addr,
    n): for V_OBJ the base is the item pointer array, for V_ARRAY the raw
    kind of the array's data; raw kinds pass through."""
    if kind == V_OBJ:
        items, m, ok = _seq(addr, tp)
        return V_OBJ, items, m, (OK if ok else E_NOT_CANONICAL)
    if kind == V_ARRAY:
        if array_ok == 0:
            return V_OBJ, 0, 0, E_NOT_CANONICAL
        # arrayobject: ob_size @16, ob_item @24, ob_descr @40 -> {char typecode; int itemsize}
        data = load_i64(addr + OFF_ITEMS)
        m = load_i64(addr + OFF_SIZE)
        descr = load_i64(addr + 40)
        code = np.int64(load_u8(descr))
        size = np.int64(load_u32(descr + 4))
        if code == 105 or code == 108 or code == 113:  # 'i', 'l', 'q'
            if size == 4:
                return V_I32, data, m, OK
            if size == 8:
                return V_I64, data, m, OK
        if code == 73 or code == 76 or code == 81:  # 'I', 'L', 'Q'
            if size == 4:
                return V_U32, data, m, OK
            if size == 8:
                return V_U64, data, m, OK
        return V_OBJ, 0, 0, E_NOT_CANONICAL
    return kind, addr, n, OK


@jit(inline="always")
def _vget(kind, base, j, tp):
    """(value, status) of element j of a vector from ``_vec``."""
    if kind == V_OBJ:
        return _int_of(_item(base, j), tp)
    if kind == V_I32:
        return np.int64(load_i32(base + 4 * j)), OK
    if kind == V_I64:
        return load_i64(base + 8 * j), OK
    if kind == V_U32:
        return np.int64(load_u32(base + 4 * j)), OK
    u = load_u64(base + 8 * j)
    if u > np.uint64(9223372036854775807):
        return 0, E_INT_RANGE
    return np.int64(u), OK


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


@jit(signature="int64(int64[::1], int64)")
def _arena_short(ctx, need_words):
    """Words missing in the arena for ``need_words`` more (0: room enough)."""
    return max(0, ctx[IX_ARENA_TOP] + need_words - ctx[IX_ARENA_CAP])


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
    need_words = 0
    for i in range(n):
        ptr, klen, st = _key_of(_item(items, i), allow, tp)
        if st != OK:
            return _set_err(ctx, st, i, 0, 0)
        if klen > ctx[IX_MAX_KEY]:
            return _set_err(ctx, E_ID_TOO_LONG, i, klen, 0)
        h = _hash_key(ptr, klen, seed, hmask)
        need_words += key_arena_words(klen)
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
    short = _arena_short(ctx, need_words)
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


# ----------------------------------------------------------------------------
# small open-addressing tables of one step's own keys (new ids, resumed ids)


@jit
def _small_table(n):
    tsize = 8
    while tsize < 2 * n:
        tsize *= 2
    return np.full(tsize, -1, np.int64), tsize - 1


@jit
def _table_find(tab, tmask, t_hash, t_ptr, t_len, h, ptr, klen):
    """Index of the key in a small table of this step's keys, or -1;
    compared by bytes."""
    s = np.int64(h & np.uint64(tmask))
    while tab[s] >= 0:
        k = tab[s]
        if t_hash[k] == h and _raw_equal(t_ptr[k], t_len[k], ptr, klen):
            return k
        s = (s + 1) & tmask
    return -1


@jit
def _table_add(tab, tmask, h, k):
    s = np.int64(h & np.uint64(tmask))
    while tab[s] >= 0:
        s = (s + 1) & tmask
    tab[s] = k
