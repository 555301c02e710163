"""Glue for vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``, vLLM 0.34).

``ModelRunnerV2State(runner)`` takes over the host side of a
``GPUModelRunner``'s request state: its ``RequestState`` (states.py) and
``BlockTables`` (block_table.py) host arrays become views of one
:class:`mtpstate.RequestTable`, and a scheduler step is applied by one
``RequestTable.apply`` instead of the per-request loops of
``finish_requests`` / ``add_requests`` / ``update_requests``. What stays per
request is what must: the runner's hooks for requests that leave or arrive
(``_remove_request``: model state, pooling, ``pp_handler.on_req_idx_freed``,
encoder cache, LoRA; and the add hooks: model state, sampler, speculator,
...). Every device-side change (block tables, lengths, new requests' token
ids) goes through the table's device mirror: one staged copy per step.

Imports no vLLM: it works on the runner object it is given. The worked patch
``mrv2.patch`` (applied by the plugin, or to a source tree) shows the calls in
the runner; ``docs/vllm.md`` maps every field.
"""

from __future__ import annotations

import logging
import operator

import numpy as np

from mtpstate._kernels import slots as _T
from mtpstate.integrations.vllm import sampler as _sampler
from mtpstate.results import StepResult, bounded_views
from mtpstate.table import RequestTable

__all__ = ["ModelRunnerV2State"]

logger = logging.getLogger("vllm.mtpstate")  # vLLM's handlers and VLLM_LOGGING_LEVEL apply
_said: set[str] = set()  # what this process has logged already (once each)


def _say_once(key: str, msg: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        logger.info(msg, *args)


def unsupported_reason(runner) -> str | None:
    """Why mtpstate cannot keep this runner's request state (None: it can).
    Decided once, when the runner's KV cache (and with it its block tables)
    is initialized; such a runner takes vLLM's own paths every step."""
    if getattr(runner, "is_pooling_model", False) or getattr(runner, "pooling_runner", None) is not None:
        return "a pooling model"
    if getattr(runner, "pcp_manager", None) is not None:
        return "prefill context parallelism (PCP)"
    if getattr(runner, "adaptive_verification", None) is not None:
        return "adaptive verification of drafts"
    if getattr(runner, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if getattr(runner, "decode_query_len", None) is None:
        return "a runner without decode_query_len"
    vllm_config = getattr(runner, "vllm_config", None)
    if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False) is True:
        # vLLM unmaps what initialize_kv_cache allocates on sleep (and brings
        # it back empty on wake): the mirror's tensors and graphs among it
        return "sleep mode (vLLM frees the memory initialize_kv_cache allocates)"
    if getattr(getattr(vllm_config, "parallel_config", None), "enable_elastic_ep", False) is True:
        # preserve_serving_state removes requests outside a step and redirects
        # block writes to the null block, neither of which the table sees
        return "elastic expert parallelism"
    for name in ("req_states", "block_tables"):
        if getattr(runner, name, None) is None:
            return f"a runner without {name}"
    return None


def ring_depth_of(runner) -> int:
    """Steps in flight at once: what vLLM sizes its own staging pools by
    (``buffer_utils.set_default_max_concurrency``: at least 2, else
    ``vllm_config.max_concurrent_batches``, pipeline stages + 1 with async
    scheduling)."""
    n = getattr(getattr(runner, "vllm_config", None), "max_concurrent_batches", 2)
    return max(2, n if isinstance(n, int) else 2)


_REQ_ID = operator.attrgetter("req_id")


class _Step:
    """The step as the table reads it: the runner frees ``finished`` (finished,
    preempted, and new ids still live: a streaming-input update re-adds them)."""

    __slots__ = (
        "finished_req_ids",
        "preempted_req_ids",
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        "scheduled_spec_decode_tokens",
        "total_num_scheduled_tokens",
    )

    def __init__(self, finished, so):
        self.finished_req_ids = finished
        self.preempted_req_ids = None
        self.scheduled_new_reqs = so.scheduled_new_reqs
        self.scheduled_cached_reqs = so.scheduled_cached_reqs
        self.num_scheduled_tokens = getattr(so, "num_scheduled_tokens", None)
        self.scheduled_spec_decode_tokens = getattr(so, "scheduled_spec_decode_tokens", None)
        self.total_num_scheduled_tokens = getattr(so, "total_num_scheduled_tokens", None)


class ModelRunnerV2State:
    """Request state of a vLLM Model Runner V2 ``GPUModelRunner``, kept by a
    :class:`RequestTable`.

    Parameters
    ----------
    runner
        The ``GPUModelRunner`` (or any object with its ``req_states``,
        ``block_tables`` and ``_remove_request``), after both were built.
    ring_depth
        Staging slots of the table's device mirror and of the ``idx_mapping``
        ring: at least the number of steps in flight (:func:`ring_depth_of`).
    ops : mtpstate.devices.DeviceOps, optional
        The mirror's device operations (tests: a ``DeferredOps``).

    Notes
    -----
    After construction these runner arrays are views of the table (same
    dtypes and shapes, so every reader in the runner is unchanged):
    ``req_states.num_computed_tokens_np``, ``num_computed_prefill_tokens``,
    ``max_seq_len``, ``prompt_len.np``, ``prefill_len.np`` and
    ``block_tables.num_blocks.np``. These device tensors are the mirror's
    (same dtype and shape), written only by its one staged copy per step:
    ``block_tables.block_tables[g].gpu``, ``block_tables.num_blocks.gpu``,
    ``req_states.prompt_len.gpu`` / ``prefill_len.gpu`` (device memory
    instead of UVA, changed only where rows change; their ``copy_to_uva()``
    copies nothing), and ``req_states.total_len.gpu`` /
    ``num_computed_tokens.gpu`` (seeded when a request is added, then
    advanced by vLLM's kernels as before). New requests' token ids are
    scattered by the same step into ``req_states.all_token_ids.gpu``
    (vLLM's UVA or device tensor), in stream order.
    ``req_states.req_id_to_index`` /
    ``index_to_req_id`` are still kept (the runner reads them elsewhere), but
    only requests that arrive or leave touch them. Rows are the table's
    (lowest free first), not vLLM's LIFO free list: the same on every
    tensor-parallel rank.
    """

    @classmethod
    def for_runner(cls, runner, fallback: bool = True) -> ModelRunnerV2State | None:
        """The state for ``runner``, or None where mtpstate does not apply
        (:func:`unsupported_reason`) or cannot be built: the runner then
        takes vLLM's own paths. Logs one INFO line per process, the first
        time, either way; a build that fails logs one WARNING naming the
        error and leaves the runner as it was.

        ``fallback``: an error of mtpstate's own while serving hands the
        runner back to vLLM (:meth:`hand_back`) instead of raising."""
        reason = unsupported_reason(runner)
        if reason is not None:
            _say_once(
                "unsupported:" + reason, "mtpstate: not used for %s; this runner keeps vLLM's own request state", reason
            )
            return None
        previous = runner.__dict__.get("_mtpstate_live")
        if previous is not None:
            # the KV cache initialized again: the state built for the last
            # one gives everything back to vLLM first (one live state)
            runner.__dict__.pop("_mtpstate_live", None)
            previous.release()
        try:
            state = cls(runner, ring_depth=ring_depth_of(runner), fallback=fallback)
        except Exception as e:  # noqa: BLE001  (never the reason vLLM stops: it runs without mtpstate)
            if not fallback:
                raise
            logger.warning(
                "mtpstate: building its request state failed (%s: %s); this runner keeps vLLM's own request "
                "state, as without mtpstate",
                type(e).__name__,
                e,
            )
            return None
        runner._mtpstate_live = state
        t = state.table
        mem = state.memory()
        _say_once(
            "active",
            "mtpstate: active; request state in one RequestTable (max_num_reqs=%d, max_model_len=%d, "
            "%d KV-cache group(s)), ring depth %d, device %s; it holds %.1f MiB of host memory (%.1f MiB "
            "pinned) and %.1f MiB on the device, outside vLLM's KV-cache budget",
            t.max_num_reqs,
            t.max_model_len,
            len(t.block_sizes),
            state.ring_depth,
            runner.req_states.device,
            mem["host_bytes"] / 2**20,
            mem["pinned_bytes"] / 2**20,
            mem["device_bytes"] / 2**20,
        )
        return state

    def __init__(self, runner, ring_depth: int = 2, ops=None, fallback: bool = False):
        rs, bt = runner.req_states, runner.block_tables
        self.ring_depth = ring_depth
        self.fallback = fallback
        self.handed_back = None  # why vLLM keeps the request state again (None: mtpstate keeps it)
        widths = [t.gpu.shape[1] for t in bt.block_tables]
        self.runner = runner
        # Everything the host changes reaches vLLM's tensors in the mirror's
        # one staged copy per step, in stream order: the block tables and
        # num_blocks, the UVA prompt/prefill lengths (only rows that changed,
        # instead of whole-array copies every step), and for new requests
        # their token ids (scattered into vLLM's all_token_ids through the
        # device, as its write kernel does), total_len and the device
        # num_computed_tokens. The host-only num_computed_tokens /
        # num_computed_prefill_tokens / max_seq_len are not shipped: vLLM's
        # device code keeps its own num_computed_tokens. The same device work
        # (one graph replay on CUDA) copies the step's batch idx_mapping for
        # prepare_inputs and zeroes the new rows' draft tokens.
        dql = getattr(runner, "decode_query_len", None)
        spec = getattr(rs, "num_speculative_steps", 0) > 0
        # prepare_inputs' query_start_loc (vLLM's persistent input buffer,
        # which its CUDA graphs read) written by the same device work
        qsl = getattr(getattr(runner, "input_buffers", None), "query_start_loc", None)
        if qsl is not None and (dql is None or tuple(qsl.shape) != (rs.max_num_reqs + 1,)):
            qsl = None
        bonus = getattr(getattr(runner, "model_state", None), "num_new_sampled_tokens_per_step", 1)
        bonus = bonus if isinstance(bonus, int) and bonus > 0 else 1
        # expand_idx_mapping's outputs, expanded with the batch: a step's
        # logits are among its tokens, so the token budget bounds them too
        max_logits = rs.max_num_reqs * (dql or 0)
        budget = getattr(runner, "max_num_tokens", None)
        if isinstance(budget, int) and 0 < budget < max_logits:
            max_logits = budget
        # all_token_ids' width, which is what vLLM can hold: with an
        # auto-fit max_model_len, vLLM shrinks req_states.max_model_len
        # after building the tensor ([max_num_reqs, its max_model_len])
        width = rs.all_token_ids.gpu.shape[1]
        self.table = RequestTable(
            max_num_reqs=rs.max_num_reqs,
            max_model_len=max(width, rs.max_model_len),
            block_sizes=list(bt.block_sizes),
            max_num_blocks_per_group=widths,
            device=rs.device,
            mirror_options={
                "ring_depth": ring_depth,
                "fields": ("prefill_len", "prompt_len", "num_blocks"),
                "engine_lengths": True,
                "token_ids_target": rs.all_token_ids.gpu,  # [max_num_reqs, max_model_len]
                "idx_mapping": dql is not None,
                "query_start_loc_target": qsl,
                "zero_rows_on_add": (rs.draft_tokens,) if spec else (),  # [max_num_reqs, num_speculative_steps]
                "ops": ops,
            },
            # the step's batch (gather_batch_req_state's BatchReqState) in the same call
            decode_query_len=dql,
            sampled_tokens_per_step=bonus,
            max_num_logits=max_logits,
        )
        self._inputs_on = qsl is not None
        self._token_views = {}  # padded tokens -> vLLM's per-token input buffers' views
        self._req_views = {}  # (inputs buffer, reqs, padded) -> the per-request views
        self._padding_pattern = None  # is_padding's values for any num_tokens, as one view
        self._padding_views = {}  # (tokens, padded tokens) -> its views
        self._idx_np = None  # the idx_mapping_np gather_batch_req_state handed out last
        self._batch = None
        self._so = None  # the step apply() applied last
        self._applied_at = -1  # the table's step count when this step's apply began (-1: between steps)
        self.sampler_answers = None
        # how to give back what is taken over (a failed build: all of it)
        self._undo: list = []
        try:
            self._take_over(runner, rs, bt)
        except BaseException:
            self._give_back_all()
            raise

    def _take_over(self, runner, rs, bt) -> None:
        t = self.table
        undo = self._undo
        d = t.device_tensors
        # the runner reads these every step; as views, apply's writes are theirs
        replaced = {}  # id(vLLM's array or tensor) -> (it, the table's in its place)
        self._uvas = []  # the UvaBackedTensors whose copy_to_uva is the mirror's

        def take(obj, name, new):
            old = getattr(obj, name)
            replaced[id(old)] = (old, new)
            undo.append(lambda: _give_back(obj, name, old, new))
            setattr(obj, name, new)

        take(rs, "num_computed_tokens_np", t.num_computed_tokens)  # [max_num_reqs]
        take(rs, "num_computed_prefill_tokens", t.num_computed_prefill_tokens)  # [max_num_reqs]
        take(rs, "max_seq_len", t.max_seq_len)  # [max_num_reqs]
        # UvaBackedTensors: host side (.np) and device side (.gpu) are the
        # table's; their per-step whole-array copy_to_uva() has nothing to do
        for uva, host, dev in (
            (rs.prompt_len, t.prompt_len, d.prompt_len),
            (rs.prefill_len, t.prefill_len, d.prefill_len),
            (bt.num_blocks, t.num_blocks, d.num_blocks),  # [num_groups, max_num_reqs]
        ):
            take(uva, "np", host)
            take(uva, "gpu", dev)
            uva.copy_to_uva = _Current(uva)
            self._uvas.append(uva)
            undo.append(lambda uva=uva: uva.__dict__.pop("copy_to_uva", None))
        # device tensors the runner's own kernels advance; seeded per new row
        take(rs.total_len, "gpu", d.total_len)  # [max_num_reqs]
        take(rs.num_computed_tokens, "gpu", d.engine_num_computed_tokens)  # [max_num_reqs]
        undo.append(bt.init_block_table_layout_tensors)  # (run after the block tables are vLLM's again)
        for g, dev in enumerate(d.block_tables):  # [max_num_reqs, W_g] each
            take(bt.block_tables[g], "gpu", dev)
        bt.init_block_table_layout_tensors()  # the kernels' pointer/stride tables
        # what the runner's other parts built before now took references to
        # those arrays (the sampler's logit-bias processor keeps
        # prompt_len.np for min_tokens): the table's in their place
        _rebind_aliases(runner, replaced, skip=(rs, bt), undo=undo)
        self._idx_ring = t._mirror.rows_ring("idx_mapping")  # (idx_mapping() of a dummy run's batch)
        # rows are the table's: vLLM's RequestState.remove_request still
        # returns its row to the free list, which nothing pops any more
        take(rs, "free_indices", _RowsKeptByTable())
        # ids finish() freed through the runner's hooks, for apply(); None: a
        # decode step (nobody leaves), applied as the scheduler sent it
        self._freeing: list[str] | None = []
        if self._inputs_on:
            self._presize_views()
        # the sampler's per-step questions, answered for each batch handed out
        # (None: no sampler here, or not exactly vLLM's; it answers itself)
        self.sampler_answers = _sampler.attach(self, getattr(runner, "sampler", None))
        if self.sampler_answers is not None:
            undo.append(self.sampler_answers.detach)
            if self.fallback:
                self.sampler_answers.failed = self._failed
            # (rows vLLM writes outside a step, as its dummy sampler run does: counted only if live)
            self.sampler_answers.row_live = rs.index_to_req_id.__contains__
        self._table_ctx_addr = t._tb_addr  # (the answers' counts read each step's rows there)

    def _give_back_all(self) -> None:
        # every object taken over is vLLM's again, holding the table's values
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            fn()

    def release(self) -> None:
        """Give everything taken over back to vLLM, holding what the table
        holds (the runner's KV cache is initialized again: its new state
        takes over from there), and free the table. After this, the
        runner's request state is vLLM's own."""
        if self.handed_back is None:
            self.handed_back = "released"
        self._give_back_all()
        self._rows_to_vllm(self.runner.req_states)
        if self.sampler_answers is not None:
            self.sampler_answers.detach()
            self.sampler_answers = None
        self.table.close()

    def _rows_added(self, req_ids: list, rows: list) -> None:
        # vLLM's id <-> row dicts, updated by C loops (no Python frame per request)
        rs = self.runner.req_states
        rs.req_id_to_index.update(zip(req_ids, rows))
        rs.index_to_req_id.update(zip(rows, req_ids))

    def _rows_to_vllm(self, rs) -> None:
        # vLLM's free list from its dicts (the rows the table assigned)
        used = set(rs.index_to_req_id)
        rs.free_indices = [r for r in range(rs.max_num_reqs - 1, -1, -1) if r not in used]

    # -- the three runner methods ---------------------------------------------

    def finish(self, scheduler_output) -> bool:
        """``finish_requests``: run the runner's per-request removal hooks
        (they need the rows, which stay valid until :meth:`apply`), in sorted
        id order as vLLM does, so that ranks agree. Unknown ids are ignored.
        Returns False where vLLM's own ``finish_requests`` must run instead:
        mtpstate handed the runner back (:meth:`hand_back`)."""
        self._applied_at = -1
        try:
            self._freeing = leaving = self._leaving(scheduler_output)
        except Exception as e:  # noqa: BLE001  (never the reason vLLM stops)
            self._failed("finish", e)
            return False
        if leaving:
            remove = self.runner._remove_request
            for req_id in leaving:
                remove(req_id)  # (vLLM's hooks: their errors are vLLM's)
        return True

    def _leaving(self, so) -> list[str] | None:
        # the ids finish() frees, sorted; None: a decode step (nobody leaves)
        fin, pre, new = so.finished_req_ids, so.preempted_req_ids, so.scheduled_new_reqs
        if not fin and not pre and not new:
            return None
        gone = set(fin)
        if pre:
            gone.update(pre)
        if new:
            # new ids already live (a streaming-input update): removed first;
            # the intersection runs in C, one lookup per new request
            gone.update(self.runner.req_states.req_id_to_index.keys() & map(_REQ_ID, new))
        return sorted(gone)

    def add_requests(self, scheduler_output) -> list[int] | None:
        """The patched ``add_requests``' call: :meth:`apply`, and the new
        requests' rows as a list (for the runner's add hooks). None where
        vLLM's own ``add_requests`` and ``update_requests`` must apply the
        step: mtpstate handed the runner back before it changed anything
        (:meth:`hand_back`)."""
        try:
            res = self.apply(scheduler_output)
            return res.new_rows.tolist()
        except Exception as e:  # noqa: BLE001  (never the reason vLLM stops)
            self._failed("add", e)
            if self.runner.mtpstate is not None:
                # (the step is applied: its rows for the hooks, vLLM's methods for the rest)
                rs = self.runner.req_states
                return [rs.req_id_to_index[r.req_id] for r in scheduler_output.scheduled_new_reqs]
            return None

    def apply(self, scheduler_output) -> StepResult:
        """``add_requests`` + ``update_requests``: apply the step (finish, add,
        update) with one ``RequestTable.apply``, whose mirror ships every
        change the step makes to vLLM's tensors in one staged copy (see the
        constructor). Returns the table's :class:`StepResult` (``new_rows``
        in the order of ``scheduled_new_reqs``, for the runner's add hooks)."""
        so = scheduler_output
        freeing = self._freeing
        new = so.scheduled_new_reqs
        answers = self.sampler_answers
        writer = None if answers is None else answers.writer
        self._so = so
        self._applied_at = self.table._steps_applied
        if new and writer is not None:
            writer.read(new)  # (their sampling params checked before anything changes)
        # a decode step (finish() found nobody leaving): the step as it is
        res = self.table.apply(so if freeing is None else _Step(freeing, so))
        self._freeing = []
        self._batch = res.batch
        if new:
            # (their draft tokens were zeroed by the step's device work)
            self._rows_added(list(map(_REQ_ID, new)), res.new_rows.tolist())
        if answers is not None:
            if new or freeing:  # (rows left or arrived: the answers' counts follow)
                answers.rows_changed(self._table_ctx_addr)
            if new and writer is not None:
                writer.arm()
        return res

    def accepts_request_id(self, req_id) -> bool:
        """Whether a request with this id can run (see
        :meth:`RequestTable.accepts_request_id`): check it when the request
        is admitted, and reject that request alone, instead of letting the
        step that adds it fail for every running request."""
        return self.table.accepts_request_id(req_id)

    def gather_batch_req_state(self, cls, uniform_decode_token_count, use_pp: bool = False):
        """``GPUModelRunner.gather_batch_req_state`` for a real step: the
        batch built by :meth:`apply`, as ``(cls(...), count)``: ``cls`` is
        vLLM's ``BatchReqState`` and ``count`` comes from its
        ``get_uniform_decode_token_count`` (both passed in, so that this
        module imports no vLLM). The arrays are copied (vLLM's ``InputBatch``
        keeps them past the next step's apply); ``max_seq_len_np`` only with
        pipeline parallelism and a prefill, as vLLM fills it. None where
        vLLM's own method must build it (:meth:`hand_back`)."""
        try:
            return self._gather(cls, uniform_decode_token_count, use_pp)
        except Exception as e:  # noqa: BLE001  (never the reason vLLM stops)
            self._failed("batch", e)
            return None

    def _gather(self, cls, uniform_decode_token_count, use_pp):
        b = self._batch
        arrays = b.copy_arrays()
        has_prefill = b.has_prefill
        if not (use_pp and has_prefill):
            arrays["max_seq_len_np"] = None
        self._idx_np = arrays["idx_mapping_np"]
        if self.sampler_answers is not None:  # (every new row's sampling params are in by now)
            self.sampler_answers.compute(self.table._cv[_T.TB_BATCH_IDX], len(self._idx_np), self._idx_np)
        state = cls(
            req_ids=b.req_ids,
            num_tokens=b.num_tokens,
            has_prefill=has_prefill,
            decode_graph_eligible=b.decode_graph_eligible,
            **arrays,
        )
        count = uniform_decode_token_count(len(b.req_ids), b.num_tokens, b.max_query_len, b.decode_graph_eligible)
        return state, count

    def batch_inputs(self, batch_req_state, num_reqs_padded: int, num_tokens_padded: int, bonus, fast_prefill):
        """``prepare_inputs``' inputs for the batch :meth:`apply` built
        (:class:`StepInputs`): its host arrays computed by the step kernel,
        its device tensors shipped by the step's own device work, every view
        made once per size. None where vLLM's own code must compute them:
        another batch (a dummy run's), fast prefill, a number of sampled
        tokens per step other than the table's, or after :meth:`hand_back`."""
        try:
            return self._batch_inputs(batch_req_state, num_reqs_padded, num_tokens_padded, bonus, fast_prefill)
        except Exception as e:  # noqa: BLE001  (never the reason vLLM stops)
            self._failed("prepare_inputs", e)
            return None

    def _batch_inputs(self, batch_req_state, num_reqs_padded, num_tokens_padded, bonus, fast_prefill):
        b = self._batch
        if (
            not self._inputs_on
            or batch_req_state.idx_mapping_np is not self._idx_np
            or fast_prefill is not None
            or bonus != self.table.sampled_tokens_per_step
        ):
            return None
        cv = self.table._cv
        n, nt = len(b.req_ids), cv[_T.TB_B_NUM_TOKENS]
        # everything per request is a view fixed by (slot, size, padded size):
        # made once, then only the step's totals and token views are set
        key = (cv[_T.TB_BIN], n, num_reqs_padded)
        si = self._req_views.get(key)
        if si is None:
            si = self._step_inputs(b, n, num_reqs_padded)
            self._req_views = bounded_views(self._req_views)
            self._req_views[key] = si
        tv = self._token_views.get(num_tokens_padded)
        if tv is None:
            ib = self.runner.input_buffers
            p = num_tokens_padded
            tv = (ib.input_ids[:p], ib.positions[:p], ib.is_padding[:p])
            self._token_views = bounded_views(self._token_views)
            self._token_views[p] = tv
        si.input_ids, si.positions, si.is_padding = tv
        si.num_tokens = nt
        si.num_logits = cv[_T.TB_B_NUM_LOGITS]
        si.num_draft_tokens = cv[_T.TB_B_NUM_DRAFTS]
        si.logits_fit = cv[_T.TB_B_LOGITS_FIT] != 0
        # (vLLM expands only a step with drafts)
        si.expanded = self.table._mirror.expanded_inputs() if cv[_T.TB_B_HAS_DRAFTS] else None
        return si

    def padding_values(self, num_tokens: int, num_tokens_padded: int):
        """The values of ``is_padding[:num_tokens_padded]`` (``num_tokens``
        False, then True) as a view of a constant device tensor, so that one
        copy writes them (vLLM: two fills), for ``VLLM_MOE_SKIP_PADDING``."""
        key = (num_tokens, num_tokens_padded)
        v = self._padding_views.get(key)
        if v is None:
            ib = self.runner.input_buffers
            T = ib.is_padding.shape[0]
            if self._padding_pattern is None:  # [2 * max_num_tokens]: False, then True
                self._padding_pattern = ib.is_padding.new_ones(2 * T)
                self._padding_pattern[:T] = False
            # (is_padding[:num_tokens_padded] holds at most T)
            v = self._padding_pattern[T - num_tokens : T - num_tokens + min(num_tokens_padded, T)]
            self._padding_views = bounded_views(self._padding_views)
            self._padding_views[key] = v
        return v

    def _presize_views(self) -> None:
        # every per-size view prepare_inputs takes, made now for every batch
        # size (and padded size) and slot: a step whose size is new builds
        # its StepInputs from them (no view made in a step)
        import torch

        t = self.table
        t._mirror.presize_views()
        t._batch.presize_views()
        R = t.max_num_reqs
        qsl_t = t._mirror._qsl_target  # vLLM's input_buffers.query_start_loc
        seq_lens = self.runner.input_buffers.seq_lens
        self._by_padded = [(qsl_t[: p + 1], seq_lens[:p]) for p in range(R + 1)]
        self._by_slot_padded = {}  # slot buffer -> [(query_start_loc_np[:p + 1], seq_lens_cpu_upper_bound[:p])]
        for addr, (rows, _, _) in t._batch._inputs.items():
            ub = torch.from_numpy(rows[_T.BI_SEQ_UB, :R])
            self._by_slot_padded[addr] = [(rows[_T.BI_QSL, : p + 1], ub[:p]) for p in range(R + 1)]

    def _step_inputs(self, b, n, num_reqs_padded):
        m = self.table._mirror
        qsl_t, cu_t, zeros = m.batch_inputs()
        si = StepInputs()
        si.query_start_loc_np = b.query_start_loc_np
        si.query_start_loc_np_padded, si.seq_lens_cpu_upper_bound = self._by_slot_padded[self.table._cv[_T.TB_BIN]][
            num_reqs_padded
        ]
        si.cu_num_logits_np = b.cu_num_logits_np
        si.num_computed_tokens_np = b.num_computed_tokens_np
        si.idx_mapping = m.idx_mapping()
        si.query_start_loc = qsl_t
        si.query_start_loc_padded, si.seq_lens = self._by_padded[num_reqs_padded]
        si.cu_num_logits = cu_t
        si.local_pos_zeros = zeros
        return si

    # -- when mtpstate fails: vLLM keeps the request state again ---------------

    def _failed(self, phase: str, error: Exception) -> None:
        # (called while handling ``error``: raised again unless the runner falls back to vLLM)
        if not self.fallback:
            raise error
        self.hand_back(f"{phase}: {type(error).__name__}: {error}")

    def hand_back(self, reason: str) -> None:
        """Give the runner's request state back to vLLM for good: vLLM's own
        bookkeeping is rebuilt from mtpstate's (the id <-> row dicts, the
        free rows, whole-array uploads of the lengths, the sampler's own
        methods), and the runner's ``mtpstate`` is set so that vLLM's
        methods run from here on. If this step was applied already (the
        table changed), the rest of the step runs vLLM's methods on that
        state (its device work finished first); if not, vLLM's methods
        apply the whole step. Logs one WARNING with ``reason``. A device
        that is unusable is vLLM's to report: its MirrorFaultError is
        raised."""
        if self.handed_back is not None:
            return
        runner, rs, t = self.runner, self.runner.req_states, self.table
        applied = 0 <= self._applied_at < t._steps_applied
        mirror = t._mirror
        if applied and mirror is not None and mirror._fault is not None:
            mirror.resync()  # (the step's device work the fault left; unusable: raised, vLLM's to report)
        if applied and self._so is not None and self._so.scheduled_new_reqs:
            # (apply may have failed before it told vLLM's dicts)
            req_ids = list(map(_REQ_ID, self._so.scheduled_new_reqs))
            self._rows_added(req_ids, t.rows(req_ids).tolist())
        self._rows_to_vllm(rs)
        for uva in self._uvas:  # vLLM's whole-array copies again
            uva.__dict__.pop("copy_to_uva", None)
        self.handed_back = reason
        runner._mtpstate_handed_back = self  # (vLLM's arrays and tensors are the table's: kept alive)
        runner.mtpstate = _StepApplied(runner) if applied else None
        if self.sampler_answers is not None:
            self.sampler_answers.failed = None
            self.sampler_answers.detach()  # (add_request calls noted and not written: vLLM's)
        logger.warning(
            "mtpstate: %s; vLLM's own methods keep this runner's request state from %s on, as without "
            "mtpstate (outputs are unchanged; this runner no longer uses mtpstate)",
            reason,
            "the rest of this step" if applied else "this step",
        )

    def memory(self) -> dict:
        """What mtpstate holds for this runner, outside vLLM's KV-cache
        budget: ``host_bytes`` (the table's arrays and index, the sampler's
        counts), ``pinned_bytes`` (the mirror's page-locked staging) and
        ``device_bytes`` (the mirror's device tensors and graph pool)."""
        t = self.table
        owned = {}  # id -> nbytes of each array allocated here (not a view)
        for obj in (t, t._index, self.sampler_answers):
            if obj is None:
                continue
            names = vars(obj) if hasattr(obj, "__dict__") else type(obj).__slots__
            for name in names:
                a = getattr(obj, name, None)
                if isinstance(a, np.ndarray) and a.base is None:
                    owned[id(a)] = a.nbytes
        host = sum(owned.values())
        stats = t.transfer_stats()
        return {
            "host_bytes": int(host),
            "pinned_bytes": int(stats.get("pinned_bytes", 0)),
            "device_bytes": int(stats.get("device_bytes", 0)),
        }

    def idx_mapping(self, idx_mapping_np: np.ndarray):
        """``prepare_inputs``' ``idx_mapping``: the batch -> row mapping as an
        int64 tensor on the runner's device. For the array
        :meth:`gather_batch_req_state` handed out, the tensor the step's own
        device work already shipped (nothing issued here); for any other (a
        dummy run's), a non-blocking copy from a ring of persistent pinned
        buffers instead of a pinned allocation per step (what
        ``async_tensor_h2d`` does). Valid for ``ring_depth`` steps, like
        every per-step input buffer of an async engine."""
        try:
            if idx_mapping_np is self._idx_np:
                return self.table.device_idx_mapping()
            return self._idx_ring.upload(idx_mapping_np)
        except Exception as e:  # noqa: BLE001  (never the reason vLLM stops)
            self._failed("prepare_inputs", e)
            return _to_device(idx_mapping_np, self.runner.device)


def _give_back(obj, name: str, old, new) -> None:
    # vLLM's own array or tensor back in place, holding the table's values
    if type(old) is type(new) and getattr(old, "shape", None) == getattr(new, "shape", None) and old is not new:
        if isinstance(old, np.ndarray):
            old[...] = new
        elif hasattr(old, "copy_"):
            old.copy_(new)
    setattr(obj, name, old)


def _to_device(a: np.ndarray, device):
    # (what vLLM's async_tensor_h2d gives: the values as an int64 tensor on the device)
    import torch

    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device, non_blocking=True)


class _StepApplied:
    """The runner's ``mtpstate`` for the rest of a step that mtpstate applied
    before it handed the runner back (:meth:`ModelRunnerV2State.hand_back`):
    the step's state is in place (vLLM's ``update_requests`` loop must not
    apply it again), everything else is vLLM's own; the next step's
    ``finish_requests`` sets ``mtpstate`` to None."""

    def __init__(self, runner):
        self._runner = runner

    def finish(self, scheduler_output) -> bool:
        self._runner.mtpstate = None
        return False

    def add_requests(self, scheduler_output):
        self._runner.mtpstate = None
        return None

    def gather_batch_req_state(self, *args, **kwargs):
        return None

    def batch_inputs(self, *args, **kwargs):
        return None

    def idx_mapping(self, idx_mapping_np):
        return _to_device(idx_mapping_np, self._runner.device)

    def accepts_request_id(self, req_id) -> bool:
        return True


def _rebind_aliases(runner, replaced: dict, skip, undo: list | None = None) -> int:
    """Replace, in the objects the runner holds (its attributes' attributes,
    and the items of their lists and tuples: the sampler's processors, ...),
    every attribute that is one of ``replaced``'s old arrays or tensors by
    the table's. Returns how many were replaced."""
    seen, n = {id(o) for o in skip}, 0
    todo = [v for v in vars(runner).values() if hasattr(v, "__dict__")]
    for depth in range(3):
        nxt = []
        for obj in todo:
            if id(obj) in seen or not hasattr(obj, "__dict__") or isinstance(obj, type):
                continue
            seen.add(id(obj))
            for name, value in list(vars(obj).items()):
                hit = replaced.get(id(value))
                if hit is not None and hit[0] is value:
                    try:
                        setattr(obj, name, hit[1])
                        if undo is not None:
                            undo.append(lambda obj=obj, name=name, old=value: setattr(obj, name, old))
                    except AttributeError:  # (a frozen object: it keeps vLLM's, and says so)
                        logger.warning("mtpstate: %s.%s still refers to vLLM's own array", type(obj).__name__, name)
                        continue
                    n += 1
                elif isinstance(value, (list, tuple)):
                    nxt.extend(v for v in value if hasattr(v, "__dict__"))
                elif hasattr(value, "__dict__") and depth < 2:
                    nxt.append(value)
        todo = nxt
    if n:
        logger.debug("mtpstate: %d reference(s) to the runner's replaced arrays rebound to the table's", n)
    return n


class StepInputs:
    """What the patched ``prepare_inputs`` takes from mtpstate for a step,
    by the names of its locals: host arrays (``query_start_loc_np`` whole
    and padded to the batch, ``cu_num_logits_np``,
    ``num_computed_tokens_np``), device tensors (``idx_mapping``,
    ``query_start_loc`` whole and padded, ``cu_num_logits``,
    ``local_pos_zeros``: expanded_local_pos without drafts; ``expanded``:
    ``(expanded_idx_mapping, expanded_local_pos)`` of a step with drafts,
    None where vLLM's ``expand_idx_mapping`` must compute them), the totals
    (``num_logits``, ``num_draft_tokens``, ``logits_fit``) and views of
    vLLM's input buffers (``input_ids``, ``positions``, ``is_padding``,
    ``seq_lens``, ``seq_lens_cpu_upper_bound``) and ``num_tokens``."""

    __slots__ = (
        "query_start_loc_np",
        "query_start_loc_np_padded",
        "cu_num_logits_np",
        "num_computed_tokens_np",
        "idx_mapping",
        "query_start_loc",
        "query_start_loc_padded",
        "cu_num_logits",
        "local_pos_zeros",
        "expanded",
        "num_logits",
        "num_draft_tokens",
        "logits_fit",
        "input_ids",
        "positions",
        "is_padding",
        "num_tokens",
        "seq_lens",
        "seq_lens_cpu_upper_bound",
    )


class _Current:
    """``UvaBackedTensor.copy_to_uva`` for a tensor the table's mirror keeps
    current on the device: nothing to copy, the device side as it is."""

    __slots__ = ("_uva",)

    def __init__(self, uva):
        self._uva = uva

    def __call__(self, n=None):
        gpu = self._uva.gpu
        return gpu if n is None else gpu[:n]


class _RowsKeptByTable(list):
    """``RequestState.free_indices`` while the table assigns rows: vLLM's
    ``remove_request`` appends the freed row (ignored: the table has freed
    it); its ``add_request``, which would pop one, is not called."""

    __slots__ = ()

    def append(self, row) -> None:
        pass

    def pop(self, *args):
        raise RuntimeError("mtpstate assigns this runner's rows; RequestState.add_request must not be called")
