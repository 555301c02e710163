"""Reference implementations: the per-request Python loop.

``LoopRequestTable`` is written the way a serving engine's model runner does
it (a dict, a free list, scalar numpy writes and a block-table append per
request). It is the baseline of every benchmark and the oracle of the
differential tests. ``LegacyRequestTable`` keeps the pre-fix behaviour that
increments ``num_computed_tokens`` by the scheduled tokens, to show the
divergence under speculative decoding.

Neither validates its input: fed a bad step they may raise half-way.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

__all__ = [
    "LoopRequestTable",
    "LegacyRequestTable",
    "LoopMirroredRequestTable",
    "VllmLoopRequestTable",
    "vllm_gather_batch",
]


class LoopRequestTable:
    """Same constructor, attributes and step semantics as
    :class:`mtpstate.RequestTable`, as a per-request Python loop."""

    def __init__(
        self, max_num_reqs, max_model_len, block_sizes=(16,), max_num_blocks_per_group=None, prefault=True, **_
    ):
        R, L = max_num_reqs, max_model_len
        widths = (
            [math.ceil(L / b) for b in block_sizes]
            if max_num_blocks_per_group is None
            else list(max_num_blocks_per_group)
        )
        self.max_num_reqs = R
        self.max_model_len = L
        self.block_sizes = tuple(block_sizes)
        self.max_num_blocks_per_group = tuple(widths)
        self.num_groups = len(widths)
        self.req_id_to_index: dict[str, int] = {}
        self.free_rows = list(range(R))  # a heap: lowest free row first
        self.num_computed_tokens = np.zeros(R, np.int32)
        self.num_computed_prefill_tokens = np.zeros(R, np.int32)
        self.prefill_len = np.zeros(R, np.int32)
        self.prompt_len = np.zeros(R, np.int32)
        self.max_seq_len = np.zeros(R, np.int32)
        self.num_blocks = np.zeros((len(widths), R), np.int32)
        self.block_tables = [np.zeros((R, w), np.int32) for w in widths]
        self.token_ids = np.zeros((R, L), np.int32)
        if prefault:  # as RequestTable does: no page faults inside steps
            for a in (self.token_ids, *self.block_tables):
                a.fill(0)

    def __len__(self):
        return len(self.req_id_to_index)

    def __contains__(self, req_id):
        return req_id in self.req_id_to_index

    def rows(self, req_ids):
        return np.array([self.req_id_to_index[r] for r in req_ids], np.int32)

    def is_prefilling(self, rows):
        rows = np.asarray(rows)
        return self.num_computed_prefill_tokens[rows] < self.prefill_len[rows]

    def _remove(self, req_id):
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            heapq.heappush(self.free_rows, row)

    def finish(self, req_ids):
        for req_id in sorted(req_ids):
            self._remove(req_id)

    def add(self, new_reqs):
        for req in new_reqs:  # re-sent requests are removed first
            if req.req_id in self.req_id_to_index:
                self._remove(req.req_id)
        for req in new_reqs:
            row = heapq.heappop(self.free_rows)
            self.req_id_to_index[req.req_id] = row
            self._write_new(row, req)

    def _write_new(self, row, req):
        prompt = req.prompt_token_ids
        tokens = req.prefill_token_ids if req.prefill_token_ids is not None else prompt
        prompt_len = len(prompt) if prompt is not None else req.prompt_len
        sp = req.sampling_params
        max_tokens = sp.max_tokens if sp is not None and sp.max_tokens is not None else 1
        self.prompt_len[row] = prompt_len
        self.prefill_len[row] = len(tokens)
        self.max_seq_len[row] = prompt_len + max_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.num_computed_prefill_tokens[row] = min(req.num_computed_tokens, len(tokens))
        self.token_ids[row, : len(tokens)] = tokens
        for g, ids in enumerate(req.block_ids):
            self.block_tables[g][row, : len(ids)] = ids
            self.num_blocks[g, row] = len(ids)

    def _append_blocks(self, row, new_blocks, overwrite):
        for g, ids in enumerate(new_blocks):
            start = 0 if overwrite else self.num_blocks[g, row]
            self.block_tables[g][row, start : start + len(ids)] = ids
            self.num_blocks[g, row] = start + len(ids)

    def update(self, cached):
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for req_id, n, new_blocks in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids):
            row = self.req_id_to_index[req_id]
            self.num_computed_tokens[row] = n  # overwrite from the scheduler
            if new_blocks is not None:
                self._append_blocks(row, new_blocks, overwrite=req_id in resumed)
        np.minimum(self.num_computed_tokens, self.prefill_len, out=self.num_computed_prefill_tokens)

    def apply(self, so):
        self.finish(set(so.finished_req_ids) | set(so.preempted_req_ids or ()))
        self.add(so.scheduled_new_reqs)
        self.update(so.scheduled_cached_reqs)


class LegacyRequestTable(LoopRequestTable):
    """The pre-fix engine: a running request's ``num_computed_tokens`` is
    advanced by the number of tokens scheduled for it in the previous step,
    instead of overwritten from the scheduler. Under speculative decoding
    rejected draft tokens are counted as computed, so the copy drifts further
    every step. Same values as the fixed engine when every draft is accepted.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scheduled_last_step: dict = {}

    def update(self, cached):
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        last = self._scheduled_last_step
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            row = self.req_id_to_index[req_id]
            self.num_computed_tokens[row] += last.get(req_id, 0)  # the bug: increment
            if new_blocks is not None:
                self._append_blocks(row, new_blocks, overwrite=req_id in resumed)
        np.minimum(self.num_computed_tokens, self.prefill_len, out=self.num_computed_prefill_tokens)

    def apply(self, so):
        super().apply(so)
        self._scheduled_last_step = dict(so.num_scheduled_tokens)


class LoopMirroredRequestTable(LoopRequestTable):
    """The loop engine's way of shipping state to a device: every write is
    also staged per request into Python lists as (row, start, values) runs,
    and at the end of the step the lists are copied into one buffer and
    scattered into a flat torch tensor on ``device``. The baseline of the
    mirror benchmarks."""

    def __init__(self, *args, device="cpu", **kwargs):
        import torch

        super().__init__(*args, **kwargs)
        self._torch = torch
        R = self.max_num_reqs
        self._fields = [
            self.num_computed_tokens,
            self.num_computed_prefill_tokens,
            self.prefill_len,
            self.prompt_len,
            self.max_seq_len,
        ]
        self._bt_off = []
        off = (5 + self.num_groups) * R
        for w in self.max_num_blocks_per_group:
            self._bt_off.append(off)
            off += R * w
        self._tok_off = off
        off += R * self.max_model_len
        self.flat = torch.zeros(off, dtype=torch.int32, device=device)
        self._staged_rows: list[int] = []
        self._staged_starts: list[int] = []
        self._staged_values: list[list[int]] = []

    def _stage(self, start, values):
        self._staged_starts.append(start)
        self._staged_values.append(values)

    def add(self, new_reqs):
        super().add(new_reqs)
        R = self.max_num_reqs
        for req in new_reqs:
            row = self.req_id_to_index[req.req_id]
            for f, arr in enumerate(self._fields):
                self._stage(f * R + row, [int(arr[row])])
            tokens = req.prefill_token_ids if req.prefill_token_ids is not None else req.prompt_token_ids
            self._stage(self._tok_off + row * self.max_model_len, list(tokens))
            for g, ids in enumerate(req.block_ids):
                self._stage((5 + g) * R + row, [len(ids)])
                self._stage(self._bt_off[g] + row * self.max_num_blocks_per_group[g], list(ids))

    def update(self, cached):
        super().update(cached)
        R = self.max_num_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            row = self.req_id_to_index[req_id]
            self._stage(row, [int(self.num_computed_tokens[row])])
            self._stage(R + row, [int(self.num_computed_prefill_tokens[row])])
            if new_blocks is not None:
                for g, ids in enumerate(new_blocks):
                    n = int(self.num_blocks[g, row])
                    self._stage((5 + g) * R + row, [n])
                    w = self.max_num_blocks_per_group[g]
                    self._stage(self._bt_off[g] + row * w + n - len(ids), list(ids))

    def apply(self, so):
        super().apply(so)
        if not self._staged_starts:
            return
        self._ship_staged()
        self._staged_starts.clear()
        self._staged_values.clear()

    def staged_elements(self):
        """The step's staged runs as (flat positions int64, values int32)."""
        lens = np.fromiter(map(len, self._staged_values), np.int64, len(self._staged_values))
        starts = np.repeat(np.array(self._staged_starts, np.int64) - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
        pos = starts + np.arange(int(lens.sum()))
        vals = np.fromiter((v for run in self._staged_values for v in run), np.int32, int(lens.sum()))
        return pos, vals

    def _ship_staged(self):
        """The step's upload: one buffer, one scatter into ``flat``."""
        pos, vals = self.staged_elements()
        torch = self._torch
        self.flat.index_copy_(
            0, torch.from_numpy(pos).to(self.flat.device), torch.from_numpy(vals).to(self.flat.device)
        )


def vllm_gather_batch(so, decode_query_len, req_id_to_index, prefill_len, num_computed_prefill_tokens, max_seq_len):
    """The batch of a step as vLLM 0.34's ``gather_batch_req_state`` builds
    it (model_runner.py; no pipeline or context parallelism, no adaptive
    verification): its sort key, fromiters and gathers, as a dict of
    ``BatchReqState``'s fields (plus ``max_query_len``)."""
    nst = so.num_scheduled_tokens
    drafts = so.scheduled_spec_decode_tokens
    num_reqs = len(nst)
    max_query_len = max(nst.values()) if nst else 0
    key = lambda r: (not drafts.get(r), (num := nst[r]) != decode_query_len, num)  # noqa: E731
    req_ids = sorted(nst, key=key)
    num_scheduled_tokens = np.fromiter(map(nst.__getitem__, req_ids), dtype=np.int32, count=num_reqs)
    idx_mapping_np = np.fromiter(map(req_id_to_index.__getitem__, req_ids), dtype=np.intp, count=num_reqs)
    prefill_len_np = prefill_len[idx_mapping_np]
    ncpt_np = num_computed_prefill_tokens[idx_mapping_np]
    is_prefilling_np = ncpt_np < prefill_len_np
    has_prefill = bool(is_prefilling_np.any())
    num_draft_tokens_np = None
    if drafts:
        num_draft_tokens_np = np.fromiter((len(drafts.get(r, ())) for r in req_ids), dtype=np.int32, count=num_reqs)
    prefill_runs_as_decode_np = None
    decode_graph_eligible = not has_prefill
    if has_prefill:
        num_new = num_scheduled_tokens if num_draft_tokens_np is None else num_scheduled_tokens - num_draft_tokens_np
        prefill_runs_as_decode_np = is_prefilling_np & ((num_new == 1) & (ncpt_np > 0))
        decode_graph_eligible = bool((prefill_runs_as_decode_np | ~is_prefilling_np).all())
    return {
        "req_ids": req_ids,
        "num_scheduled_tokens": num_scheduled_tokens,
        "num_tokens": so.total_num_scheduled_tokens,
        "num_draft_tokens_np": num_draft_tokens_np,
        "idx_mapping_np": idx_mapping_np,
        "prefill_len_np": prefill_len_np,
        "num_computed_prefill_tokens_np": ncpt_np,
        "is_prefilling_np": is_prefilling_np,
        "max_seq_len_np": max_seq_len[idx_mapping_np],
        "has_prefill": has_prefill,
        "prefill_runs_as_decode_np": prefill_runs_as_decode_np,
        "decode_graph_eligible": decode_graph_eligible,
        "max_query_len": max_query_len,
    }


def vllm_expand_idx_mapping(idx_mapping, cu_num_logits, max_expand_len):
    """vLLM 0.34's ``expand_idx_mapping`` (input_batch.py, its Triton kernel
    as a loop): per request, ``next_power_of_2(max_expand_len)`` entries at
    most of its row and 0, 1, ... at ``cu_num_logits[i]``; what the kernel
    leaves unwritten is -1 here (uninitialized memory in vLLM)."""
    m = int(cu_num_logits[-1])
    block = 1 << max(int(max_expand_len) - 1, 0).bit_length()  # triton.next_power_of_2
    exp_idx = np.full(m, -1, np.int64)
    exp_pos = np.full(m, -1, np.int32)
    for i, row in enumerate(idx_mapping):
        start, k = int(cu_num_logits[i]), int(cu_num_logits[i + 1] - cu_num_logits[i])
        for j in range(min(k, block)):
            exp_idx[start + j] = row
            exp_pos[start + j] = j
    return exp_idx, exp_pos


def vllm_prepare_inputs_host(
    batch, num_computed_tokens, max_num_reqs, num_bonus_tokens=1, decode_query_len=1, max_num_logits=None
):
    """The host arrays vLLM 0.34's ``prepare_inputs`` computes for a batch
    (model_runner.py; its general branch, which gives the same values as the
    no-draft one; no request padding: ``seq_lens_cpu_upper_bound`` is
    returned ``max_num_reqs`` long, zeros past the batch), as a dict of
    :class:`mtpstate.BatchReqState`'s input fields. The expanded arrays are
    what ``expand_idx_mapping`` writes, where mtpstate computes them: every
    request has at most ``decode_query_len`` logits and the step at most
    ``max_num_logits`` (default ``max_num_reqs * decode_query_len``); else
    None."""
    nst = batch["num_scheduled_tokens"]
    idx = batch["idx_mapping_np"]
    num_reqs = len(nst)
    num_tokens = int(nst.sum())
    drafts = batch["num_draft_tokens_np"]
    if drafts is None:
        drafts = np.zeros(num_reqs, dtype=np.int32)
    num_logits = drafts + num_bonus_tokens
    cu_num_logits_np = np.empty(num_reqs + 1, dtype=np.int32)
    cu_num_logits_np[0] = 0
    np.cumsum(num_logits, out=cu_num_logits_np[1:])
    query_start_loc_np = np.empty(max_num_reqs + 1, dtype=np.int32)
    query_start_loc_np[0] = 0
    np.cumsum(nst, out=query_start_loc_np[1 : num_reqs + 1])
    query_start_loc_np[num_reqs + 1 :] = num_tokens
    num_computed_tokens_np = num_computed_tokens[idx]
    seq_lens_cpu_upper_bound_np = np.zeros(max_num_reqs, dtype=np.int32)
    np.add(num_computed_tokens_np, nst, out=seq_lens_cpu_upper_bound_np[:num_reqs])
    if max_num_logits is None:
        max_num_logits = max_num_reqs * decode_query_len
    exp_idx = exp_pos = None
    if (num_logits <= decode_query_len).all() and cu_num_logits_np[-1] <= max_num_logits:
        exp_idx, exp_pos = vllm_expand_idx_mapping(idx, cu_num_logits_np, decode_query_len)
    return {
        "query_start_loc_np": query_start_loc_np,
        "cu_num_logits_np": cu_num_logits_np,
        "expanded_idx_mapping_np": exp_idx,
        "expanded_local_pos_np": exp_pos,
        "seq_lens_cpu_upper_bound_np": seq_lens_cpu_upper_bound_np,
        "num_computed_tokens_np": num_computed_tokens_np,
        "num_logits": int(cu_num_logits_np[-1]),
        "num_draft_tokens": int(drafts.sum()),
        "logits_fit": bool((nst >= num_logits).all()),
    }


class VllmLoopRequestTable(LoopRequestTable):
    """What vLLM 0.34's Model Runner V2 host path does per step, as a loop:
    finish (sorted ids, a LIFO free list), add, update, then
    ``gather_batch_req_state`` (its sort key, the fromiters, one dict lookup
    per request for ``idx_mapping``, the gathers). ``apply`` returns that
    batch as a dict of ``BatchReqState``'s fields (:func:`vllm_gather_batch`).

    Writes go straight into the host arrays (MRV2 stages them into Python
    lists and flushes them with a copy and a kernel: a little more work
    than this baseline does)."""

    def __init__(self, *args, decode_query_len=1, sampled_tokens_per_step=1, max_num_logits=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.decode_query_len = decode_query_len
        self.bonus = sampled_tokens_per_step
        self.max_num_logits = max_num_logits
        self.free_rows = list(range(self.max_num_reqs - 1, -1, -1))  # LIFO: pop() gives row 0 first

    def _remove(self, req_id):
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def add(self, new_reqs):
        d = self.req_id_to_index
        for req in new_reqs:
            if req.req_id in d:  # re-sent: removed first
                self._remove(req.req_id)
            row = self.free_rows.pop()
            d[req.req_id] = row
            self._write_new(row, req)

    def apply(self, so):
        fin = so.finished_req_ids
        pre = so.preempted_req_ids
        self.finish(sorted(fin | pre) if pre else sorted(fin))
        self.add(so.scheduled_new_reqs)
        self.update(so.scheduled_cached_reqs)
        batch = vllm_gather_batch(
            so,
            self.decode_query_len,
            self.req_id_to_index,
            self.prefill_len,
            self.num_computed_prefill_tokens,
            self.max_seq_len,
        )
        batch.update(
            vllm_prepare_inputs_host(
                batch,
                self.num_computed_tokens,
                self.max_num_reqs,
                self.bonus,
                self.decode_query_len,
                self.max_num_logits,
            )
        )
        return batch
