"""Shared test helpers: compare a RequestTable with the loop oracle."""

import copy

import numpy as np
from hypothesis import strategies as st

from mtpstate._kernels import slots as T

# the simulator's knobs that shape a trace (each test adds its sizes)
SIM_KNOBS = {
    "num_spec": st.integers(0, 4),
    "accept": st.floats(0, 1),
    "preempt_prob": st.floats(0, 0.4),
    "abort_prob": st.floats(0, 0.3),
    "abort_waiting_prob": st.floats(0, 0.3),
    "prefix_hit_prob": st.floats(0, 0.5),
    "remote_kv_prob": st.floats(0, 0.5),
    "resume_mode": st.sampled_from(["new", "cached"]),
    "seed": st.integers(0, 2**32),
}

FIELDS = ["num_computed_tokens", "num_computed_prefill_tokens", "prefill_len", "prompt_len", "max_seq_len"]


def assert_tables_agree(fast, loop):
    """Every field of every live row equal (rows included)."""
    live = sorted(loop.req_id_to_index)
    assert len(fast) == len(loop)
    rows = np.array([loop.req_id_to_index[r] for r in live], np.int32)
    assert fast.rows(live).tolist() == rows.tolist()
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(fast, name)[rows], getattr(loop, name)[rows], err_msg=name)
    np.testing.assert_array_equal(fast.num_blocks[:, rows], loop.num_blocks[:, rows])
    for g in range(loop.num_groups):
        for r in rows:
            n = loop.num_blocks[g, r]
            np.testing.assert_array_equal(fast.block_tables[g][r, :n], loop.block_tables[g][r, :n])
    for r in rows:
        n = loop.prefill_len[r]
        np.testing.assert_array_equal(fast.token_ids[r, :n], loop.token_ids[r, :n])
    np.testing.assert_array_equal(fast.is_prefilling(rows), loop.is_prefilling(rows))


def table_snapshot(t):
    arrays = [t._state.copy(), t.token_ids.copy(), *(bt.copy() for bt in t.block_tables)]
    ix = t._index
    arrays += [ix._slots.copy(), ix._row_hash.copy(), ix._keys.copy(), ix._key_len.copy()]
    # the current prediction buffer (a rejected step may scribble on the other)
    cur, n = int(t._ctx[T.TB_PREV_CUR]), int(t._ctx[T.TB_PREV_N])
    arrays += [t._prev_obj[cur, :n].copy(), t._prev_row[cur, :n].copy()]
    return arrays, len(t), n


def assert_same_snapshot(a, b):
    assert a[1] == b[1] and a[2] == b[2]
    for x, y in zip(a[0], b[0]):
        np.testing.assert_array_equal(x, y)


def genericize(so, rng):
    """The same step with other container types: tuples, numpy arrays,
    numpy ints, str subclasses (the generic input path)."""
    so = copy.deepcopy(so)
    c = so.scheduled_cached_reqs
    c.req_ids = tuple(c.req_ids)
    c.num_computed_tokens = np.array(c.num_computed_tokens, np.int64)
    c.new_block_ids = [None if b is None else tuple(np.array(g, np.int32) for g in b) for b in c.new_block_ids]
    for r in so.scheduled_new_reqs:
        r.prompt_token_ids = np.array(r.prompt_token_ids, np.int64) if rng.random() < 0.5 else tuple(r.prompt_token_ids)
        if r.prefill_token_ids is not None:
            r.prefill_token_ids = tuple(r.prefill_token_ids)
        r.num_computed_tokens = np.int64(r.num_computed_tokens)
        r.block_ids = [np.array(g, np.int32) for g in r.block_ids]
    so.finished_req_ids = frozenset(so.finished_req_ids)
    return so


def run_differential(cfg, steps, **knobs):
    """Drive RequestTable and the loop oracle with one simulated trace and
    compare every field of every live row after every step."""
    from mtpstate import RequestTable
    from mtpstate.tools.reference import LoopRequestTable
    from mtpstate.tools.sim import Simulator

    sim = Simulator(**cfg, **knobs)
    fast, loop = RequestTable(**cfg), LoopRequestTable(**cfg)
    for so in sim.run(steps):
        fast.apply(so)
        loop.apply(so)
        assert_tables_agree(fast, loop)


# the device mirror as the vLLM adapter configures it (mtpstate.integrations.vllm)
ENGINE_FIELDS = ("prefill_len", "prompt_len", "num_blocks")


def engine_mirror_options(target, **extra) -> dict:
    """Mirror options: only ENGINE_FIELDS, the engine's lengths, new token
    ids scattered into ``target``; ``extra``: ring depth, capacity, ..."""
    return {"fields": ENGINE_FIELDS, "engine_lengths": True, "token_ids_target": target, **extra}


class EngineSeeds:
    """What each row's last add must have seeded into an engine's tensors
    (its token ids, total_len and num_computed_tokens), which nothing else
    writes: record every applied step, then check the device side."""

    def __init__(self):
        self.rows = {}  # row -> (prefill token ids, num_computed_tokens)

    def record(self, so, res) -> None:
        for r, row in zip(so.scheduled_new_reqs, res.new_rows.tolist()):
            self.rows[row] = (list(r.prefill_token_ids or r.prompt_token_ids), r.num_computed_tokens)

    def check(self, table, target) -> None:
        d = table.device_tensors
        rows = sorted(self.rows)
        # one device -> host copy per tensor (in stream order on a GPU)
        tok, total, nct = target[rows].cpu(), d.total_len[rows].cpu(), d.engine_num_computed_tokens[rows].cpu()
        for k, row in enumerate(rows):
            tokens, n_computed = self.rows[row]
            assert tok[k, : len(tokens)].tolist() == tokens, f"row {row}: token ids"
            assert int(total[k]) == len(tokens), f"row {row}: total_len"
            assert int(nct[k]) == n_computed, f"row {row}: num_computed_tokens"


def apply_through_arrays(table, so) -> None:
    """One scheduler step through the array entry point: ``finish``, ``add``,
    then ``update_arrays`` with the cached requests' blocks as CSR arrays
    (one KV-cache group)."""
    table.finish(set(so.finished_req_ids) | set(so.preempted_req_ids or ()))
    table.add(so.scheduled_new_reqs)
    c = so.scheduled_cached_reqs
    counts = [0 if b is None else len(b[0]) for b in c.new_block_ids]
    offsets = [np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)]
    values = [np.array([x for b in c.new_block_ids if b is not None for x in b[0]], np.int32)]
    table.update_arrays(c.req_ids, np.array(c.num_computed_tokens, np.int64), offsets, values)
