"""numba kernels that read a step's new requests in place, first in the
step (reading them may run Python code).

A new request reaches the general step (step.py) as one descriptor of
NEW_STRIDE int64 (``N_*``: the id object, prompt_len, num_computed_tokens,
max_tokens, the token vector, the block_ids object), made one of two ways:

- ``read_new_requests``: from the scheduler's NewRequestData objects, read
  in place (the usual path). Attribute reads may run Python code (a
  property), so they come first in the step, before anything else is read,
  and every object read is held in a list the table owns (``H_*`` slots)
  until the step returns. An attribute of a type the kernel does not read
  (a generator, a numpy array, prompt embeddings, ...) sends the step to the
  Python reader (``E_NEW_SLOW``), which takes what was read from that list:
  each attribute is read once.
- ``descriptors_from_list``: from the flat list of ints table.py builds on
  that path.

add.py validates and writes them from the descriptors.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.cpython import (
    OFF_SIZE,
    OFF_TYPE,
    err_clear,
    getattr_held,
    incref,
    is_subtype,
    list_new,
    list_set_item,
)
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import load_i64, view_i64
from mtpstate._kernels.pyobjects import INT_NONE, INT_NOT_INT, INT_RANGE, _int_of, _item, _seq, read_int
from mtpstate._kernels.slots import (
    H_BLOCKS,
    H_MAX_TOKENS,
    H_NCT,
    H_PREFILL,
    H_PROMPT,
    H_REQ,
    H_REQ_ID,
    H_SP,
    H_STRIDE,
    N_BLK,
    N_KEY,
    N_MAXT,
    N_NCT,
    N_PLEN,
    N_TOK,
    N_TOK_KIND,
    N_TOK_N,
    NEW_STRIDE,
    TB_NEW_HOLDER,
    TB_NEW_NAMES,
    _err,
)
from mtpstate._kernels.status import (
    E_CHANGED,
    E_INT_RANGE,
    E_NEW_READ,
    E_NEW_SLOW,
    E_NOT_CANONICAL,
    FLD_NONE,
    OK,
    PH_NEW,
    V_ARRAY,
    V_OBJ,
)


@jit(signature="int64(int64, int64, int64, int64)")
def _hold(holder, slot, obj, name):
    """``getattr(obj, name)`` into slot ``slot`` of the holder list (which
    owns it from then on); the value's address, or 0 when the read raised
    (the slot then holds the exception)."""
    v, exc = getattr_held(obj, name)
    if v == 0 and exc == 0:  # pragma: no cover - CPython always sets one
        err_clear()
        return 0
    list_set_item(holder, slot, v if v != 0 else exc)
    return v


@jit(signature="int64(int64, UniTuple(int64, 10), int64, int64)")
def _token_kind(obj, tp, array_type, array_ok):
    """V_* kind of a token container read in place (exact list or tuple, an
    array.array or a subclass such as vLLM's TokenBuffer), -1 otherwise."""
    t = load_i64(obj + OFF_TYPE)
    if t == tp[0] or t == tp[1]:
        return V_OBJ
    if array_ok != 0 and (t == array_type or is_subtype(t, array_type) != 0):
        return V_ARRAY
    return -1


@jit
def _describe_read(nd, k, got, tp, array_type, array_ok):
    """Descriptor k from the attributes read (``got``, by H_* slot); False
    when one of them is of a type only the Python reader takes."""
    none = tp[5]
    rid = got[H_REQ_ID]
    if load_i64(rid + OFF_TYPE) != tp[2]:
        return False
    prompt = got[H_PROMPT]
    if prompt == none:  # prompt embeddings: prompt_len from the request
        return False
    tokens = got[H_PREFILL] if got[H_PREFILL] != none else prompt
    tkind = _token_kind(tokens, tp, array_type, array_ok)
    if tokens != prompt and _token_kind(prompt, tp, array_type, array_ok) < 0:
        return False  # (its length is read in place too)
    blocks = got[H_BLOCKS]
    t_blocks = load_i64(blocks + OFF_TYPE)
    if tkind < 0 or not (t_blocks == tp[0] or t_blocks == tp[1]) or got[H_NCT] == none:
        return False
    nct, k_nct = read_int(got[H_NCT], tp[4], none)
    mt, k_mt = read_int(got[H_MAX_TOKENS], tp[4], none)
    if k_nct == INT_NOT_INT or k_mt == INT_NOT_INT:
        return False
    if k_nct == INT_RANGE:
        nct = -1  # (pass 1 rejects it)
    if k_mt == INT_NONE:
        mt = 1  # (None: 1, as vLLM takes it)
    elif k_mt == INT_RANGE:
        mt = -1  # (pass 1 rejects it)
    d = k * NEW_STRIDE
    nd[d + N_KEY] = rid
    nd[d + N_PLEN] = load_i64(prompt + OFF_SIZE)  # item count (list, tuple, array)
    nd[d + N_NCT] = nct
    nd[d + N_MAXT] = mt
    nd[d + N_TOK_KIND] = tkind
    nd[d + N_TOK] = tokens
    nd[d + N_TOK_N] = 0
    nd[d + N_BLK] = blocks
    return True


@jit
def read_new_requests(tb, tp, reqs, nd, array_ok):
    """Fill the descriptors ``nd`` [nn * NEW_STRIDE] from the scheduler's
    NewRequestData objects (``reqs``: an exact list or tuple) read in place:
    req_id, prompt_token_ids, prefill_token_ids, block_ids,
    num_computed_tokens, sampling_params and its max_tokens (a missing
    sampling_params counts as max_tokens 1). Returns OK; E_NEW_READ (at the
    request and H_* slot) when a read raised; E_NEW_SLOW when a value's type
    is one the kernel does not read; E_CHANGED when a property changed the
    list. Nothing of the table is touched."""
    none = tp[5]
    items, nn, ok = _seq(reqs, tp)
    names = view_i64(tb[TB_NEW_NAMES], H_STRIDE)  # array.array, then the attribute names
    array_type = names[H_REQ]
    holder = list_new(nn * H_STRIDE)
    if holder == 0:  # no memory: let the Python reader fail the same way
        err_clear()
        return _err(tb, E_NEW_SLOW, -1, 0, PH_NEW, FLD_NONE)
    for s in range(nn * H_STRIDE):
        incref(none)
        list_set_item(holder, s, none)
    list_set_item(tb[TB_NEW_HOLDER], 0, holder)  # (the table's 1-item list owns it now)
    got = np.empty(H_STRIDE, np.int64)
    slow = False
    for k in range(nn):
        items, n_now, ok = _seq(reqs, tp)  # a property may have changed the list
        if n_now != nn:
            return _err(tb, E_CHANGED, k, n_now, PH_NEW, FLD_NONE)
        r = _item(items, k)
        base = k * H_STRIDE
        incref(r)
        list_set_item(holder, base + H_REQ, r)
        for h in range(H_REQ_ID, H_MAX_TOKENS):  # req_id .. sampling_params
            got[h] = _hold(holder, base + h, r, names[h])
            if got[h] == 0:
                return _err(tb, E_NEW_READ, k, h, PH_NEW, FLD_NONE)
        got[H_MAX_TOKENS] = none
        if got[H_SP] != none:
            got[H_MAX_TOKENS] = _hold(holder, base + H_MAX_TOKENS, got[H_SP], names[H_MAX_TOKENS])
            if got[H_MAX_TOKENS] == 0:
                return _err(tb, E_NEW_READ, k, H_MAX_TOKENS, PH_NEW, FLD_NONE)
        if not _describe_read(nd, k, got, tp, array_type, array_ok):
            slow = True
    if slow:
        return _err(tb, E_NEW_SLOW, -1, nn, PH_NEW, FLD_NONE)
    return OK


@jit
def descriptors_from_list(tb, tp, lst, nd, nn):
    """Fill the descriptors ``nd`` from the flat list of ints table.py built
    (the Python reader's path). An int outside int64 becomes -1, which pass 1
    rejects with the field's error."""
    items, n, ok = _seq(lst, tp)
    for i in range(nn * NEW_STRIDE):
        v, st = _int_of(_item(items, i), tp)
        if st == E_INT_RANGE:
            v = -1
        elif st != OK:  # pragma: no cover - built by table.py
            return _err(tb, E_NOT_CANONICAL, i // NEW_STRIDE, 0, PH_NEW, FLD_NONE)
        nd[i] = v
    return OK
