"""A step's trip to the device: the kernels stage into the open slot
(``begin_step``), ``end_step`` ships it on the mirror's path: one graph
replay (``graph``), the same operations one by one (``eager``) or the
host's own writes (``host``, the CPU), then the slot's event; token ids past
the slot's token area go through the overflow ring, a chunk at a time."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import slots as T
from mtpstate._kernels.tokens import tok_fill
from mtpstate.errors import CapacityError
from mtpstate.mirror.faults import _Fault
from mtpstate.mirror.graphs import V_NEW, V_PLAIN, V_TOK
from mtpstate.mirror.layout import _host_scatter


class _Ship:
    """Per step: open a slot, ship it, and the order of its operations
    (``_done`` counts those queued: a failed step resumes after them)."""

    def begin_step(self, what: str = "apply"):
        """Point the kernels at a free staging slot (waiting only if the ring
        is full); what a failed step left is issued first."""
        if self._blocked or (self.asynchronous and self.ops.capturing()):
            self._usable(what)
        if self._fault is not None:
            self.resync()
        if self._open is None:
            slot = self._slots[self._next]
            if slot.pending:
                self._wait(slot)  # its replay may still be reading it
            self._open = slot
            cv = self.table._cv  # (the context as Python ints: cheaper than numpy scalars)
            cv[T.TB_STG_POS], cv[T.TB_STG_VAL], cv[T.TB_STG_CAP] = slot.state.addrs
            cv[T.TB_STG_ON] = 1
            if slot.inputs is not None:
                cv[T.TB_BIN] = slot.inputs_addr
                cv[T.TB_BEXP] = slot.exp_addr
        self.table._cv[T.TB_STG_N] = 0

    def abort_step(self):
        """Close a step that will ship nothing (rejected, or already ended)."""
        if self._open is not None:
            self._open = None
            self.table._cv[T.TB_STG_ON] = 0

    def capacity_error(self, need: int) -> CapacityError:
        return CapacityError(
            f"the step stages {need} elements on the device, more than the mirror's {self._cap} per step "
            "(mirror_options 'staging_capacity'; its default holds every step a table of this shape accepts, "
            "except a request re-sent as resumed in the step that added it); nothing was applied"
        )

    def check_staged(self, need: int, what: str) -> None:
        """Before a call that changes the host outside the step kernel (the
        array entry point): usable, and ``need`` elements fit a slot."""
        self._usable(what)
        if need > self._cap:
            raise self.capacity_error(need)

    def end_step(self, n: int, n_tok: int = 0, deduplicate: bool = False, results: bool = True):
        """Ship the first ``n`` staged elements of the open slot and the
        step's ``n_tok`` token ids (its token area's, then the overflow
        chunks'), and, with ``results``, what the step's results add (the
        batch's idx_mapping, the new rows to zero); returns without waiting.
        A failure of the device work raises :class:`~mtpstate.MirrorFaultError`;
        what was not queued is issued by the next call."""
        t = self.table
        cv = t._cv
        nb = cv[T.TB_B_N] if results and self._idx_on else -1
        nn = cv[T.TB_RES_NN] if results and self._fills else 0
        if n == 0 and n_tok == 0 and nb < 0 and nn == 0:  # nothing to ship: the slot stays open for the next step
            cv[T.TB_STG_N] = 0
            self._last = None
            return
        slot = self._open
        self._open = None
        self._next = (self._next + 1) % len(self._slots)  # (on the host too: idx_mapping lives ring_depth steps)
        cv[T.TB_STG_ON] = 0  # nothing is staged between steps
        if deduplicate:  # the same element written twice in one step: keep the last write
            p = slot.state.pos_np[:n][::-1]
            _, first = np.unique(p, return_index=True)
            keep = np.sort(n - 1 - first)
            m = len(keep)
            pos, val = slot.state.pos_np[keep], slot.state.val_np[keep]
            slot.state.pos_np[:m] = pos
            slot.state.val_np[:m] = val
            n = m
        if self.path == "graph":  # the counts the graph reads on the device
            slot.state.meta_np[0] = n
            if n_tok:
                slot.tokens.meta_np[0] = n_tok if n_tok <= self._tcap else self._tcap
        if nb >= 0:
            slot.idx_np[:nb] = t._b_idx[:nb]
            self._idx_slot, self._idx_n = slot, nb
        elif slot.inputs is not None and self._idx_slot is not None:
            # no batch (the array entry point): the target gets what it last got
            slot.inputs_np[T.BI_QSL] = self._idx_slot.inputs_np[T.BI_QSL]
        if nn:
            nc = cv[T.TB_RES_NC]
            new = t._res[nc : nc + nn]
            slot.rows_np[:nn] = new
            slot.rows_np[nn:] = new[0]  # padding: the same row zeroed again
        self._nn = nn
        self._last = (n, n_tok, nb >= 0, nn > 0, 0)
        self._ship(slot, n, n_tok)

    def _ship(self, slot, n, n_tok):
        """The step's device work: its slot's (one replay, or the same work
        issued eagerly, or run by the host), the slot's event, then any
        overflow chunks."""
        tcap = self._tcap
        m = n_tok if n_tok <= tcap else tcap  # token ids in the slot's token area
        self._shipped = m  # token ids of the step queued so far (or in the slot's work)
        self._done = 0
        slot_done = False
        try:
            if self.asynchronous:
                ops = self.ops
                if ops.stream_key() != self._stream_key:
                    self._follow_stream()
                self._slot_work(slot, n, m, self._nn, 0)
                slot_done = True
                slot.pending = True  # (before the record: a failed record leaves it to the drain)
                ops.record(slot.event, self._stream)
            else:  # the CPU (_slot_work's host branch, inline: the host path's every step)
                st = slot.state
                self._flat_np[st.pos_np[:n]] = st.val_np[:n]
                if slot.inputs is not None:
                    self._qsl_target_np[:] = slot.inputs_np[T.BI_QSL]
                self._done = 1
                if m or self._nn:
                    self._host_rest(slot, m, self._nn, 1)
                slot_done = True
            if n_tok > m:
                self._ship_overflow(n_tok, self.table._cv[T.TB_RES_NN])
        except BaseException as e:
            self._failed(e, _Fault(slot, n, m, self._nn, self._done, slot_done, None), n_tok)

    def _slot_work(self, slot, n, m, nn, start):
        """Issue the slot's device work for ``n`` staged elements, ``m`` token
        ids and ``nn`` new rows, one operation at a time in order, from its
        operation ``start`` on (those before were queued by the call that
        failed); ``_done`` counts the operations queued."""
        if self.path == "graph":  # one operation: the replay
            if start == 0:
                kind = V_TOK if m else V_NEW if nn else V_PLAIN
                key = (kind, slot.state.bucket(n), slot.tokens.bucket(m) if m else None)
                self.ops.replay(slot.graphs[key][0])
            self._done = 1
            return
        if self.path == "host":  # the CPU: the host's writes (the same memory), in order
            if start == 0:
                st = slot.state
                self._flat_np[st.pos_np[:n]] = st.val_np[:n]
                if slot.inputs is not None:
                    self._qsl_target_np[:] = slot.inputs_np[T.BI_QSL]
                self._done = 1
            if m or nn:
                self._host_rest(slot, m, nn, start)
            return
        for k, op in enumerate(self._eager_ops(slot, n, m, nn)):
            if k >= start:
                op()
                self._done = k + 1

    def _host_rest(self, slot, m, nn, start):
        """The host's writes after the staged elements: the token ids, then
        the new rows zeroed in each engine tensor (operations 1, 2, ...)."""
        k = 1
        if m:
            if start <= k:
                _host_scatter(self._tok_np, slot.tokens, m)
                self._done = k + 1
            k += 1
        for z in self._fills if nn else ():
            if start <= k:
                self.ops.fill_rows(z, slot.rows[:nn], 0)
                self._done = k + 1
            k += 1

    def _eager_ops(self, slot, n, m, nn):
        """The slot's work as separate operations (no graph to replay)."""
        ops = self.ops
        yield from self._eager_scatter(slot.state, n, self._dstate, self._flat, self._dummy)
        if m:
            yield from self._eager_scatter(slot.tokens, m, self._dtok, self._tok_dst, None)
        if slot.idx is not None:
            yield lambda: ops.copy(slot.didx, slot.idx)
        if slot.inputs is not None:
            yield lambda: ops.copy(self._qsl_target, slot.qsl)
            yield lambda: ops.copy(slot.dcu, slot.cu)
        if nn:
            yield lambda: ops.copy(slot.drows, slot.rows)
            for z in self._fills:
                yield lambda z=z: ops.fill_rows(z, slot.drows, 0)

    def _eager_scatter(self, area, n, dev, target, spare):
        """An area's work as separate operations: padding written by the
        host (to the spare element, or repeating the first element), the
        bucket's copies, the scatter."""
        ops = self.ops
        bi = area.bucket(n)
        b = area.sizes[bi]
        if spare is None:
            area.pos_np[n:b] = area.pos_np[0]
            area.val_np[n:b] = area.val_np[0]
        else:
            area.pos_np[n:b] = spare
        hpos, hval = area.views[bi]
        dpos, p, dval = dev.views[bi]
        return [lambda: ops.copy(dpos, hpos), lambda: ops.copy(dval, hval), lambda: ops.scatter(target, p, dval)]

    def _issue(self, items):
        """Issue each item in order, removing it once queued (what is left
        after a failure is what never ran)."""
        while items:
            items[0]()
            del items[0]

    def _record(self, guarded):
        if self.asynchronous:
            guarded.pending = True  # (before the record: a failed record leaves it to the drain)
            self.ops.record(guarded.event, self._stream)

    def _wait(self, guarded):
        """Wait for a slot's or chunk's last work; a device that cannot answer is unusable."""
        try:
            guarded.wait_idle(self.ops)
        except Exception as e:
            self._unusable(e)

    def _ship_overflow(self, n_tok, nruns):
        """The step's token ids past its slot's token area, a chunk at a
        time through the overflow ring: fill (from the step's runs), one
        replay (or its work eagerly, or the host's), one event."""
        ixc = self.table._ix_addr
        while self._shipped < n_tok:
            c = self._chunks[self._next_chunk]
            self._next_chunk = (self._next_chunk + 1) % len(self._chunks)
            if c.pending:
                self._wait(c)
            a = c.tokens
            m = tok_fill(ixc, self._tok_runs_addr, nruns, self._shipped, a.capacity, a.addrs[0], a.addrs[1])
            self._issue(self._chunk_items(c, m))
            self._shipped += m
            self._record(c)
            n, tok, idx, rows, chunks = self._last
            self._last = (n, tok, idx, rows, chunks + 1)

    def _chunk_items(self, chunk, m):
        a = chunk.tokens
        if self.path == "graph":
            a.meta_np[0] = m
            g = chunk.graphs[a.bucket(m)][0]
            return [lambda: self.ops.replay(g)]
        if self.path == "host":
            return [lambda: _host_scatter(self._tok_np, a, m)]
        return self._eager_scatter(a, m, self._dtok, self._tok_dst, None)

    def _follow_stream(self):
        """The consumer moved to another stream (or this is the first step):
        its work from now on runs after everything queued on the previous
        one, so steps still apply in order."""
        ops = self.ops
        cur = ops.current_stream()
        if self._stream is not None:
            ops.wait_stream(cur, self._stream)
        self._stream, self._stream_key = cur, ops.stream_key()
