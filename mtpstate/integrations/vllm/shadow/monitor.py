"""One live runner's shadow: fed every step vLLM's runner takes, it applies
the step to its own runner (:class:`~.standin.ShadowRunner`, kept by
mtpstate) and compares, by request id, the host state and the new requests'
sampler values after ``update_requests``, then the batch, the input arrays
and the sampler's answers after ``prepare_inputs``; every ``every`` steps
also the device tensors (:class:`~.checks.DeviceCheck`). The first
disagreement, or any exception of its own, ends it with one WARNING; it
never raises into vLLM."""

from __future__ import annotations

import logging
import time

import numpy as np

from mtpstate.integrations.vllm.shadow import checks, columns
from mtpstate.integrations.vllm.shadow.checks import Disagreement, Rows

logger = logging.getLogger("vllm.mtpstate")


class Shadow:
    """mtpstate beside one live vLLM runner (see the module docstring).

    Parameters
    ----------
    live
        vLLM's ``GPUModelRunner``.
    methods
        The patched runner methods (``(class, method)`` -> function).
    runner_class
        vLLM's ``GPUModelRunner`` class.
    every
        Compare the device tensors every this many steps.
    log_every
        One INFO line every this many steps.
    ops : mtpstate.devices.DeviceOps, optional
        The shadow mirror's device operations (tests: a ``DeferredOps``,
        flushed before each device check as a stream would order it).
    """

    def __init__(self, live, methods: dict, runner_class, every: int = 16, log_every: int = 1000, ops=None):
        from mtpstate.integrations.vllm.adapter import ModelRunnerV2State, ring_depth_of, unsupported_reason
        from mtpstate.integrations.vllm.shadow.standin import ShadowRunner

        reason = unsupported_reason(live)
        if reason is not None:
            raise _Unsupported(reason)
        if live.req_states.req_id_to_index:
            raise _Unsupported("a runner with requests already running (the shadow begins with an empty runner)")
        self.every, self.log_every = max(1, int(every)), max(1, int(log_every))
        self._live = live
        self._ops = ops
        device_bytes = _device_bytes(live.req_states.device)
        self.runner = ShadowRunner(live, methods, runner_class)
        self.runner.mtpstate = ModelRunnerV2State(self.runner, ring_depth=ring_depth_of(live), ops=ops)
        self.device_bytes = _device_bytes(live.req_states.device) - device_bytes
        self.answers = self.runner.mtpstate.sampler_answers
        self.active = True
        self.steps = 0  # steps applied and compared
        self.batches = 0  # of them, batches compared (steps that ran prepare_inputs)
        self.device_checks = 0
        self.values = 0
        self.disagreements = 0
        self.first: Disagreement | None = None
        self.first_step: int | None = None  # the step that found it
        self.stopped: str | None = None
        self._rng = None  # numpy's global RNG before vLLM's add_requests drew its seeds
        self._new_ids: list = []
        self._rows: Rows | None = None  # the step's live ids and both sides' rows of them
        self._pending: list[checks.DeviceCheck] = []
        # new rows' engine lengths as each side seeded them, gathered on the
        # device in the step that added them (vLLM's kernels advance them
        # after its forward), compared at the next device check
        self._seeded: list = []
        self._cost_ns = 0  # the shadow's host time since the last INFO line
        self._cost_steps = 0
        self.cost_ns_total = 0

    # -- the hooks (each called by the wrappers, which catch what they raise)

    def before_add(self, scheduler_output) -> None:
        """Before vLLM's ``add_requests``: keep numpy's RNG state, from which
        vLLM draws unseeded requests' seeds, for the shadow's same draws."""
        if scheduler_output.scheduled_new_reqs:
            self._rng = np.random.get_state()

    def after_update(self, scheduler_output) -> None:
        """After vLLM's ``update_requests``: apply the step to the shadow,
        compare the state (every live request) and the new requests' sampler
        values."""
        t0 = time.perf_counter_ns()
        so = scheduler_output
        new = so.scheduled_new_reqs
        saved = None
        if new and self._rng is not None:
            saved = np.random.get_state()
            np.random.set_state(self._rng)
        try:
            self.runner.apply(so)
        finally:
            if saved is not None:
                np.random.set_state(saved)  # vLLM's stream of draws goes on as without the shadow
            self._rng = None
        self.steps += 1
        self._new_ids = [r.req_id for r in new]
        out: list = []
        added = self._compare_state(out, self._new_ids)
        if added is not None and not out:
            self._seed_snapshot(added)
        self._done(out, t0)

    def _seed_snapshot(self, added: Rows) -> None:
        if self._ops is not None:
            self._ops.synchronize()  # (the modelled device's queued work first, as a stream orders it)
        live, sr = self._live, self.runner
        keep: list = []
        dev = live.req_states.device
        vr, mr = checks.upload(added.vllm, dev, keep), checks.upload(added.mtpstate, dev, keep)
        mine = columns.engine_device_columns(sr.req_states)
        pairs = {name: (a[vr], mine[name][mr]) for name, a in columns.engine_device_columns(live.req_states).items()}
        self._seeded.append((self.steps, added.ids, pairs, keep))

    def after_prepare(self, scheduler_output, batch_req_state, batch_desc, input_batch) -> None:
        """After vLLM's ``prepare_inputs``: compare the batch, the input
        arrays and the sampler's answers; every ``every`` batches enqueue
        the device comparison; read the device comparisons that arrived."""
        t0 = time.perf_counter_ns()
        out: list = []
        live, sr = self._live, self.runner
        sb = sr.gather(scheduler_output)
        vb = batch_req_state
        self.batches += 1
        self._compare_batch(out, vb, sb)
        n = len(vb.req_ids)
        num_reqs_padded = batch_desc.num_reqs or n
        num_tokens_padded = max(vb.num_tokens, batch_desc.num_tokens)
        si = sr.mtpstate.batch_inputs(
            sb, num_reqs_padded, num_tokens_padded, sr.model_state.num_new_sampled_tokens_per_step, live.fast_prefill
        )
        if si is not None:
            self._compare_inputs(out, input_batch, si)
        if self.answers is not None and self.answers.idx is sb.idx_mapping_np:
            want = columns.vllm_answers(live.sampler, vb.idx_mapping_np)
            got = columns.mtpstate_answers(sr.sampler, self.answers, sb.idx_mapping_np)
            for k, v in want.items():
                self.values += checks.values_equal(out, f"sampler answer {k}", v, got[k])
        if not out and self.batches % self.every == 0:
            self._device_check(input_batch, si)
        self._poll(out)
        self._done(out, t0)

    # -- comparisons

    def _compare_state(self, out: list, new_ids: list, every_column: bool = False) -> Rows | None:
        """Every live request's state (``every_column``: and the columns
        written only at add, and every sampler value), the new requests'
        columns written at add; returns the new requests' rows (None: none)."""
        live, sr = self._live, self.runner
        vi, si = live.req_states.req_id_to_index, sr.req_states.req_id_to_index
        if not checks.same_ids(out, vi, si):
            return None
        rows = self._rows = Rows.of(vi, si)
        mine = columns.state_columns(sr.req_states, sr.block_tables)
        added = Rows.of(vi, si, new_ids) if new_ids else None
        for name, a in columns.state_columns(live.req_states, live.block_tables).items():
            if name not in columns.ADDED_ONLY or every_column:
                self.values += checks.rows_equal(out, name, a, mine[name], rows)
            elif added is not None:
                self.values += checks.rows_equal(out, name, a, mine[name], added)
        if sr.sampler is not None and (added is not None or every_column):
            mine = columns.sampler_columns(sr.sampler)
            which = rows if every_column else added
            for name, (a, _) in columns.sampler_columns(live.sampler).items():
                self.values += checks.rows_equal(out, f"sampler.{name}", a, mine[name][0], which)
        return added

    def _compare_batch(self, out: list, vb, sb) -> None:
        self.values += checks.values_equal(out, "batch.req_ids", list(vb.req_ids), list(sb.req_ids))
        for f in (*columns.BATCH_FIELDS, "max_seq_len_np"):  # (both sides: gather's)
            self.values += checks.values_equal(out, f"batch.{f}", getattr(vb, f), getattr(sb, f))
        self._same_rows(out, "batch.idx_mapping_np", vb.idx_mapping_np, sb.idx_mapping_np)

    def _same_rows(self, out: list, name: str, v: np.ndarray, m: np.ndarray) -> None:
        """Two arrays of rows (vLLM's, mtpstate's), as request ids: vLLM's
        rows through the step's row map (:meth:`_compare_state`)."""
        to_mine = self._rows.row_map(self._live.req_states.max_num_reqs)
        if v.dtype != m.dtype or v.shape != m.shape or not np.array_equal(to_mine[v], m):
            vi = self._live.req_states.index_to_req_id
            mi = self.runner.req_states.index_to_req_id
            a, b = [vi.get(int(r)) for r in v[:16]], [mi.get(int(r)) for r in m[:16]]
            out.append(Disagreement(None, f"{name} (as request ids)", (v.dtype, a), (m.dtype, b)))
        self.values += len(v)

    def _compare_inputs(self, out: list, ib, si) -> None:
        eq = checks.values_equal
        self.values += eq(out, "input_batch.query_start_loc_np", ib.query_start_loc_np, si.query_start_loc_np_padded)
        self.values += eq(out, "input_batch.cu_num_logits_np", ib.cu_num_logits_np, si.cu_num_logits_np)
        self.values += eq(
            out, "input_batch.num_computed_tokens_np", ib.num_computed_tokens_np, si.num_computed_tokens_np
        )
        ub_v, ub_m = ib.seq_lens_cpu_upper_bound.numpy(), si.seq_lens_cpu_upper_bound.numpy()
        self.values += eq(out, "input_batch.seq_lens_cpu_upper_bound", ub_v, ub_m)
        if ib.num_draft_tokens_per_req is not None:
            self.values += eq(out, "input_batch.num_draft_tokens", int(ib.num_draft_tokens), int(si.num_draft_tokens))

    def _device_check(self, ib, si) -> None:
        """Enqueue the device comparison of every live request's device
        state and sampler values, and of the batch's device inputs."""
        if self._ops is not None:
            self._ops.synchronize()  # (a model of a device: its queued work before ours, as a stream orders it)
        import torch

        out: list = []
        self._compare_state(out, [], every_column=True)  # (the host side of every column, too)
        if out:
            self._report(out[0], "host")
            return
        live, sr = self._live, self.runner
        dev = live.req_states.device
        rows = self._rows  # (this step's, as _compare_state found them)
        c = checks.DeviceCheck(self.steps, dev)
        vr, mr = c.index(rows.vllm), c.index(rows.mtpstate)
        mine = columns.state_device_columns(sr.req_states, sr.block_tables)
        for name, a in columns.state_device_columns(live.req_states, live.block_tables).items():
            c.add(name, a[vr], mine[name][mr], rows.ids)
        for step, ids, pairs, keep in self._seeded:  # (as seeded, before vLLM's kernels advanced them)
            c._keep.extend(keep)
            for name, (a, b) in pairs.items():
                c.add(f"{name} as seeded in step {step}", a, b, ids)
        self._seeded = []
        if rows.ids:
            # block tables up to each request's number of blocks; token ids up to its prefill length
            nb = live.block_tables.num_blocks.np
            for g, (vt, mt) in enumerate(zip(live.block_tables.block_tables, sr.block_tables.block_tables)):
                w = int(nb[g][rows.vllm].max())
                if w:
                    mask = torch.arange(w, device=dev)[None, :] < c.index(nb[g][rows.vllm])[:, None]
                    c.add(f"block_tables[{g}].gpu", vt.gpu[vr, :w], mt.gpu[mr, :w], rows.ids, mask)
            pl = live.req_states.prefill_len.np[rows.vllm]
            w = int(pl.max())
            if w:
                mask = torch.arange(w, device=dev)[None, :] < c.index(pl)[:, None]
                vt, mt = live.req_states.all_token_ids.gpu, sr.req_states.all_token_ids.gpu
                c.add("all_token_ids.gpu", vt[vr, :w], mt[mr, :w], rows.ids, mask)
        if sr.sampler is not None:
            mine = columns.sampler_columns(sr.sampler)
            for name, (_, a) in columns.sampler_columns(live.sampler).items():
                if a is not None:
                    c.add(f"sampler.{name}.gpu", a[vr], mine[name][1][mr], rows.ids)
        if si is not None:
            to_mine = c.index(rows.row_map(live.req_states.max_num_reqs))
            c.add("input_batch.idx_mapping", to_mine[ib.idx_mapping], si.idx_mapping)
            c.add("input_batch.query_start_loc", ib.query_start_loc, si.query_start_loc_padded)
            c.add("input_batch.cu_num_logits", ib.cu_num_logits, si.cu_num_logits)
            if si.expanded is not None and ib.num_draft_tokens_per_req is not None:
                c.add("input_batch.expanded_idx_mapping", to_mine[ib.expanded_idx_mapping], si.expanded[0])
                c.add("input_batch.expanded_local_pos", ib.expanded_local_pos, si.expanded[1])
        c.launch()
        self.device_checks += 1
        self._pending.append(c)

    def _poll(self, out: list) -> None:
        while self._pending and self._pending[0].ready():
            c = self._pending.pop(0)
            self.values += c.values
            out.extend(c.disagreements())

    # -- the outcome

    def _done(self, out: list, t0: int) -> None:
        if out:
            self._report(out[0], "host")
        dt = time.perf_counter_ns() - t0
        self._cost_ns += dt
        self.cost_ns_total += dt
        if self.active and self.steps % self.log_every == 0 and self._cost_steps != self.steps:
            logger.info(
                "mtpstate shadow: %d steps compared (%d batches, %d device checks, %d values), 0 disagreements; "
                "shadow cost %.1f us per step over the last %d",
                self.steps,
                self.batches,
                self.device_checks,
                self.values,
                self._cost_ns / 1e3 / max(1, self.steps - self._cost_steps),
                self.steps - self._cost_steps,
            )
            self._cost_ns, self._cost_steps = 0, self.steps

    def _report(self, d: Disagreement, where: str) -> None:
        if not self.active:
            return
        self.disagreements += 1
        self.first, self.first_step = d, self.steps
        self.stop(
            f"mtpstate shadow: disagreement at step {self.steps} ({where}): {d.full()}. vLLM's runner and "
            "mtpstate's differ here; shadowing stops, vLLM runs on as before. Please report it with "
            "`mtpstate vllm-check --json` and this line."
        )

    def fail(self, where: str, error: BaseException) -> None:
        """An exception of the shadow's own (a request mtpstate refuses, a
        bug): shadowing stops, vLLM runs on."""
        from mtpstate.errors import StateError

        if isinstance(error, StateError):
            why = (
                "mtpstate refuses this step's input, which vLLM takes: with VLLM_USE_MTPSTATE=1 "
                "this step would fail (admit requests with ModelRunnerV2State.accepts_request_id)"
            )
        else:
            why = "an error of the shadow's own"
        self.stop(
            f"mtpstate shadow: stopped at step {self.steps + 1} in {where}: {type(error).__name__}: {error} "
            f"({why}). Shadowing stops; vLLM runs on as before."
        )

    def stop(self, message: str) -> None:
        """End shadowing with one WARNING and let go of the shadow's state."""
        if not self.active:
            return
        self.active = False
        self.stopped = message
        self._pending, self._seeded = [], []
        self.runner = None  # (its memory, host and device, goes back)
        logger.warning("%s", message)

    def report(self) -> dict:
        """What the shadow did so far."""
        return {
            "active": self.active,
            "steps": self.steps,
            "batches": self.batches,
            "device_checks": self.device_checks,
            "values": self.values,
            "disagreements": self.disagreements,
            "first": None if self.first is None else self.first.full(),
            "first_step": self.first_step,
            "stopped": self.stopped,
            "cost_us_per_step": self.cost_ns_total / 1e3 / max(1, self.steps),
            "device_bytes": self.device_bytes,
        }


class _Unsupported(Exception):
    """A runner mtpstate does not keep (the shadow has nothing to compare)."""


def _device_bytes(device) -> int:
    try:
        import torch

        if torch.device(device).type == "cuda":
            return int(torch.cuda.memory_allocated(device))
    except Exception:  # noqa: BLE001  (a figure for the log line only)
        pass
    return 0
