"""The graphs a step replays: per staging slot, one per kind of step and
size bucket (and token bucket), per overflow chunk one per token bucket,
captured once when the table is built. Each replays on the consumer's
stream: the slot's copies to the device, its scatters, and by kind the
batch's ``idx_mapping`` and inputs and the new rows zeroed. The same work is
what the eager path issues where no graph can be captured."""

from __future__ import annotations

# kinds of step, one graph each per slot and bucket
V_PLAIN = 0  # the staged elements (+ idx_mapping)
V_NEW = 1  # + the new rows zeroed in the engine's tensors
V_TOK = 2  # + the token area scattered into the token target (one graph per token bucket)


class _Graphs:
    """Capturing the step's device work (``DeviceMirror.attach`` calls
    ``_capture_graphs`` last); a capture that fails leaves the eager path."""

    def _kinds(self) -> list[int]:
        return [V_PLAIN] + ([V_NEW] if self._fills else []) + ([V_TOK] if self._tcap else [])

    def _capture_graphs(self):
        """Every graph, once: per slot, each kind of step at each bucket (and
        token bucket), and per overflow chunk each token bucket. A capture
        that fails leaves the eager path, said in ``path`` and ``graph_error``."""
        if self.path != "graph":
            return
        ops, torch = self.ops, self._torch
        try:
            n = max(self._cap, self._tcap)
            self._iota = self._device(n, torch.int64)  # [max(cap, token_chunk)]: sliced per bucket, shared
            self._iota.copy_(torch.arange(n, dtype=torch.int64))
            self._spare = torch.full((1,), self._dummy, dtype=torch.int64, device=self._iota.device)
            self._device_bytes += 8
            self._warm_up()
            reserved = ops.memory_reserved()
            pool = None
            for s in self._slots:
                for key in self._graph_keys():
                    pool = self._capture(s, key, self._step_work(s, *key), pool)
            for c in self._chunks:
                for ti in range(len(c.tokens.sizes)):
                    pool = self._capture(c, ti, self._chunk_work(c, ti), pool)
            ops.synchronize()
            self._pool_bytes = max(0, ops.memory_reserved() - reserved)
        except Exception as e:  # any capture failure (out of memory included): the same work, issued eagerly
            for s in (*self._slots, *self._chunks):
                s.graphs.clear()
            self.path, self.graph_error = "eager", f"capture failed: {e!r}"

    def _graph_keys(self):
        nb = len(self._slots[0].state.sizes)
        nt = len(self._slots[0].tokens.sizes) if self._tcap else 0
        for kind in self._kinds():
            for bi in range(nb):
                if kind == V_TOK:
                    for ti in range(nt):
                        yield (kind, bi, ti)
                else:
                    yield (kind, bi, None)

    def _capture(self, owner, key, work, pool):
        g = self.ops.capture(work, pool)
        if pool is None and hasattr(g, "pool"):
            pool = g.pool()  # one memory pool for all: the replays never overlap
        # the graph reads the tensors the work was captured with (its views
        # of the shared buffers): they live as long
        owner.graphs[key] = (g, work)
        return pool

    def _warm_up(self):
        """Each kind's work run once eagerly (so that lazy module loads happen
        outside any capture) on the first slot's zeroed buffers: the headers
        say nothing is staged, so the flat tensor gets only the spare
        element, and the token scatter and the row fills go to scratch
        tensors in place of the engine's: nothing an engine holds is written."""
        torch = self._torch
        s0 = self._slots[0]
        tok = torch.zeros(1, dtype=torch.int32, device=self._flat.device)
        fills = [torch.zeros((1, *z.shape[1:]), dtype=z.dtype, device=z.device) for z in self._fills]
        for kind in self._kinds():
            self._step_work(s0, kind, 0, 0 if kind == V_TOK else None, tok, fills)()
        self.ops.synchronize()

    def _scatter_work(self, area, bi, dev, target, spare):
        """An area's first bucket-``bi`` elements and header copied to the
        device, then its live elements (the header's count) scattered into
        ``target``; the rest go to the ``spare`` position, or, without one,
        rewrite the first element with its own value."""
        torch = self._torch
        hpos, hval = area.views[bi]
        dpos, p, dval = dev.views[bi]
        iota = self._iota[: area.sizes[bi]]

        def work():
            dpos.copy_(hpos, non_blocking=True)
            dval.copy_(hval, non_blocking=True)
            live = iota < dpos[0]
            if spare is None:
                target.index_copy_(0, torch.where(live, p, p[0]), torch.where(live, dval, dval[0]))
            else:
                target.index_copy_(0, torch.where(live, p, spare), dval)

        return work

    def _step_work(self, slot, kind, bi, ti=None, tok=None, fills=None):
        """The device work of one step of ``kind`` whose staged elements fit
        bucket ``bi`` (and token ids token bucket ``ti``): the slot's
        scatters, and by kind the batch's idx_mapping, the new rows zeroed
        (``tok``, ``fills``: other targets than the engine's, for the warm-up)."""
        parts = [self._scatter_work(slot.state, bi, self._dstate, self._flat, self._spare)]
        if kind == V_TOK:
            parts.append(self._scatter_work(slot.tokens, ti, self._dtok, self._tok_dst if tok is None else tok, None))
        fills = () if kind == V_PLAIN else self._fills if fills is None else fills
        qsl = self._qsl_target if slot.inputs is not None else None

        def work():
            for part in parts:
                part()
            if slot.idx is not None:
                slot.didx.copy_(slot.idx, non_blocking=True)
            if qsl is not None:
                qsl.copy_(slot.qsl, non_blocking=True)
                slot.dcu.copy_(slot.cu, non_blocking=True)
            if fills:
                slot.drows.copy_(slot.rows, non_blocking=True)
                for z in fills:
                    z.index_fill_(0, slot.drows, 0)

        return work

    def _chunk_work(self, chunk, ti):
        return self._scatter_work(chunk.tokens, ti, self._dtok, self._tok_dst, None)
