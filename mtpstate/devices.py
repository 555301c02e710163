"""The device operations the mirror issues, behind one small interface.

The mirror's per-step device work is one *replay* of a captured graph (the
step's copies and scatters) on the consumer's stream, then one *event
record* that guards the staging slot the replay reads. Around it: allocation
(pinned host staging, device buffers), a host wait on an event, a cheap
identity of the current stream (to notice that the consumer moved to another
stream), and, on the eager path, the copies and scatters themselves. Three
implementations:

- :class:`CudaOps`: torch on a CUDA device (CUDA graphs, events made once);
- :class:`ImmediateOps`: torch on the CPU, every operation run by the host
  when issued (no graphs, no streams, no events);
- :class:`DeferredOps`: a model of a GPU's asynchrony for tests. Copies,
  scatters and replays are queued on a stream and run later, in stream
  order, reading their source when they run, not when issued (a replay runs
  the captured work then, reading the pinned slot as it is at that moment);
  an event completes only when the work queued before its record has run; a
  stream wait holds the waiting stream's later work until the other stream
  has reached the point of the wait; of several writes of a scatter to one
  element, the first wins (on a GPU which one wins is undefined); a graph
  holds its captured work weakly, as a CUDA graph holds no reference to the
  tensors it reads. Tests can
  hold a stream back, run the queued work in any legal order, count every
  operation issued (``issued``), make the k-th operation fail
  (``fail_at``), lose the device for good (``lose_device``: a sticky error)
  and capture a stream as an engine would (``begin_capture``: what would
  break that capture is noted), which is how CI checks the ordering, the
  fault handling and the capture rules that only a GPU would otherwise
  exercise.
"""

from __future__ import annotations

import collections
import contextlib
import random
import weakref

__all__ = ["CudaOps", "DeferredOps", "DeviceLost", "DeviceOps", "ImmediateOps", "ops_for"]


class DeviceOps:
    """What the mirror needs from a device.

    ``asynchronous``: device work may still be pending when the host goes on
    (host writes into memory the device reads are then a hazard).
    ``graphs``: work can be captured once and replayed (:meth:`capture`)."""

    asynchronous = False
    graphs = False

    def __init__(self, torch, device):
        self.torch = torch
        self.device = torch.device(device)

    # allocation
    def pinned_empty(self, n: int, dtype):
        return self.torch.empty(n, dtype=dtype)

    def empty(self, n: int, dtype):
        return self.torch.empty(n, dtype=dtype, device=self.device)

    # streams and events
    def stream_key(self):
        """A cheap identity of the current stream of the mirror's device."""
        return 0

    def current_stream(self):
        return None

    def wait_stream(self, waiter, waitee) -> None:
        """``waiter``'s work issued from now on runs after the work queued
        on ``waitee`` so far."""

    def new_event(self):
        return None

    def record(self, event, stream) -> None:
        """Record ``event`` (made once by :meth:`new_event`) on ``stream``."""

    def host_wait(self, event) -> None:
        """Block the host until ``event``'s last record has completed."""

    def synchronize(self) -> None:
        """Block the host until every queued operation has run."""

    # work, queued on the current stream
    def copy(self, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def scatter(self, target, positions, values) -> None:
        target.index_copy_(0, positions, values)

    def fill_rows(self, target, rows, value) -> None:
        target.index_fill_(0, rows, value)

    def memory_reserved(self) -> int:
        """Device memory the allocator holds (0 where it does not say)."""
        return 0

    # graphs
    def capturing(self) -> bool:
        """Whether the mirror device's current stream is being captured (an
        engine's own graph capture): the mirror then issues nothing."""
        return False

    def capture(self, work, pool=None):
        """Capture ``work()`` (device operations on tensors that outlive the
        graph) once; returns the graph, replayed by :meth:`replay`."""
        raise NotImplementedError

    def replay(self, graph) -> None:
        """Queue the captured work on the current stream."""
        raise NotImplementedError


class ImmediateOps(DeviceOps):
    """torch on the CPU: the host runs every operation as it is issued."""


class CudaOps(DeviceOps):
    """torch on a CUDA device: pinned staging, CUDA graphs, events made once."""

    asynchronous = True
    graphs = True

    def __init__(self, torch, device):
        super().__init__(torch, device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._index = self.device.index
        # (a private torch binding: the raw handle of the current stream, no
        # Stream object made; where it is missing, the public lookup)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw = raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)
        self._capture_stream = None

    def pinned_empty(self, n, dtype):
        return self.torch.empty(n, dtype=dtype, pin_memory=True)

    def stream_key(self):
        return self._raw(self._index)

    def current_stream(self):
        # the mirror's device, which need not be the current device
        return self.torch.cuda.current_stream(self.device)

    def wait_stream(self, waiter, waitee):
        waiter.wait_stream(waitee)

    def new_event(self):
        return self.torch.cuda.Event()

    def record(self, event, stream):
        event.record(stream)

    def host_wait(self, event):
        event.synchronize()

    def synchronize(self):
        self.torch.cuda.synchronize(self.device)

    def memory_reserved(self):
        return self.torch.cuda.memory_reserved(self.device)

    def capturing(self):
        # every apply asks: the private bindings where the mirror's device is
        # the current one (no device switch, no Python wrappers)
        C = self.torch._C
        get_device = getattr(C, "_cuda_getDevice", None)
        is_capturing = getattr(C, "_cuda_isCurrentStreamCapturing", None)
        if get_device is not None and is_capturing is not None and get_device() == self._index:
            return bool(is_capturing())
        with self.torch.cuda.device(self.device):
            return self.torch.cuda.is_current_stream_capturing()

    def capture(self, work, pool=None):
        torch = self.torch
        with torch.cuda.device(self.device):
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(self.device)
            s = self._capture_stream
            s.wait_stream(torch.cuda.current_stream(self.device))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s):
                # thread_local: an engine's other threads may use CUDA meanwhile
                g.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    work()
                finally:
                    g.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(s)
        return g

    def replay(self, graph):
        # on the current stream of the graph's device
        graph.replay()


def ops_for(torch, device) -> DeviceOps:
    device = torch.device(device)
    return CudaOps(torch, device) if device.type == "cuda" else ImmediateOps(torch, device)


# ----------------------------------------------------------------------------
# the deferred model, for tests


class _Stream:
    def __init__(self, name: str):
        self.name = name
        self.queue: list = []  # pending operations: (kind, payload)
        self.issued = 0  # operations ever queued
        self.ran = 0  # operations run (a prefix of the issued ones)
        self.held = False

    def __repr__(self):
        return f"<stream {self.name}: {self.ran}/{self.issued}>"


class _Event:
    """Made once, recorded many times: complete once its stream has run
    what was queued before the last record (never recorded: complete)."""

    def __init__(self, stream: _Stream | None = None):
        self.stream = stream
        self.at = 0 if stream is None else stream.issued

    @property
    def done(self) -> bool:
        return self.stream is None or self.stream.ran >= self.at


class _Graph:
    """Captured work, run later when a replay reaches it. Held weakly, as a
    CUDA graph holds the memory of the tensors it was captured with but no
    reference to them: the capturer must keep them alive."""

    def __init__(self, work):
        self.work = weakref.ref(work)


class InjectedFault(RuntimeError):
    """The failure :class:`DeferredOps` raises at its ``fail_at``-th operation."""


class DeviceLost(RuntimeError):
    """What :class:`DeferredOps` raises for everything after ``lose_device``."""


class DeferredOps(DeviceOps):
    """A device whose work runs only when the model decides (see the module
    docstring). Its tensors live on the CPU.

    Parameters
    ----------
    torch
        The torch module.
    seed
        Seeds the order in which :meth:`run_some` picks among the streams
        that can run.
    graphs
        Whether capture and replay are offered (False: the mirror's eager
        path).
    """

    asynchronous = True

    def __init__(self, torch, seed: int = 0, graphs: bool = True):
        super().__init__(torch, "cpu")
        self.graphs = graphs
        self.default = _Stream("default")  # the consumer's (model's) stream
        self.streams = [self.default]
        self._current = self.default
        self.rng = random.Random(seed)
        self.ops_run = 0
        self.issued = collections.Counter()  # operations issued, by kind
        self.fail_at = None  # the issued operation (counting all kinds from 0) that raises ...
        self.fault = InjectedFault  # ... this
        self.fail_on = None  # or the next operation of this kind (then None again)
        self._capturing = set()  # ids of the streams an engine is capturing
        self.capture_violations = []  # what was issued that would have broken such a capture
        self.lost = None  # why the device is lost (lose_device), or None

    def _issue(self, kind: str) -> None:
        self._during_capture(kind)
        k = sum(self.issued.values())
        self.issued[kind] += 1
        if self.lost is not None:
            raise DeviceLost(f"device operation {k} ({kind}) on a lost device: {self.lost}")
        if (self.fail_at is not None and k == self.fail_at) or self.fail_on == kind:
            self.fail_on = None
            raise self.fault(f"injected fault at device operation {k} ({kind})")

    # -- an engine's graph capture, and a device lost for good ---------------

    def begin_capture(self, stream=None) -> None:
        """An engine starts capturing ``stream`` (default: the current one).
        What CUDA would then reject or take into that capture is noted in
        ``capture_violations``: work or an event record on that stream, a
        host wait or synchronize, an allocation."""
        self._capturing.add(id(stream or self._current))

    def end_capture(self, stream=None) -> None:
        self._capturing.discard(id(stream or self._current))

    def capturing(self) -> bool:
        return id(self._current) in self._capturing

    def _during_capture(self, what: str) -> None:
        if self._capturing and (id(self._current) in self._capturing or what in ("sync", "alloc")):
            self.capture_violations.append(what)

    def lose_device(self, why: str = "an illegal memory access") -> None:
        """A sticky device error: every later operation, wait and
        synchronize raises :class:`DeviceLost`."""
        self.lost = why

    def pinned_empty(self, n, dtype):
        self._during_capture("alloc")
        return super().pinned_empty(n, dtype)

    def empty(self, n, dtype):
        self._during_capture("alloc")
        return super().empty(n, dtype)

    def new_stream(self):
        s = _Stream(f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def stream_key(self):
        return id(self._current)

    def current_stream(self):
        return self._current

    @contextlib.contextmanager
    def on_stream(self, stream):
        prev, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = prev

    def _enqueue(self, stream, kind, payload):
        stream.queue.append((kind, payload))
        stream.issued += 1

    def enqueue(self, fn, stream=None) -> None:
        """Queue ``fn()`` (e.g. a test's stand-in for a kernel that reads a
        tensor) on ``stream`` (default: the current one); not counted."""
        self._enqueue(stream or self._current, "run", fn)

    def wait_stream(self, waiter, waitee):
        self._issue("wait")
        self._enqueue(waiter, "wait", _Event(waitee))

    def new_event(self):
        return _Event()

    def record(self, event, stream):
        self._issue("record")
        event.stream, event.at = stream, stream.issued

    def copy(self, dst, src):
        self._issue("copy")
        self._enqueue(self._current, "run", lambda: dst.copy_(src))  # reads src when it runs

    def scatter(self, target, positions, values):
        self._issue("scatter")
        # which of several writes to one position wins is undefined on a GPU:
        # here the first, the opposite of a sequential loop
        self._enqueue(self._current, "run", lambda: target.index_copy_(0, positions.flip(0), values.flip(0)))

    def fill_rows(self, target, rows, value):
        self._issue("fill")
        self._enqueue(self._current, "run", lambda: target.index_fill_(0, rows, value))

    def capture(self, work, pool=None):
        self._issue("capture")
        return _Graph(work)

    def replay(self, graph):
        self._issue("replay")
        if graph.work() is None:
            raise RuntimeError("a graph replayed after the tensors it was captured with were freed")
        ref = graph.work  # (weakly until it runs, as a queued replay keeps no tensor alive)

        def run():
            work = ref()
            if work is None:
                raise RuntimeError("a queued replay ran after the tensors its graph was captured with were freed")
            work()  # reads the pinned slot when it runs

        self._enqueue(self._current, "run", run)

    # -- running the queued work ---------------------------------------------

    def runnable(self, stream) -> bool:
        if not stream.queue:
            return False
        kind, payload = stream.queue[0]
        return kind != "wait" or payload.done

    def run_one(self, stream) -> None:
        kind, payload = stream.queue.pop(0)
        if kind == "run":
            payload()
            self.ops_run += 1
        stream.ran += 1

    def _run_until(self, event) -> None:
        """Run what ``event`` needs (holding back nothing: a host wait is
        answered eventually however late the device is)."""
        s = event.stream
        while not event.done:
            kind, payload = s.queue[0]
            if kind == "wait" and not payload.done:
                self._run_until(payload)
            self.run_one(s)

    def host_wait(self, event):
        self._sync_check()
        if event.stream is not None:
            self._run_until(event)

    def synchronize(self):
        self._sync_check()
        for s in self.streams:
            self._run_until(_Event(s))

    def _sync_check(self):
        self._during_capture("sync")
        if self.lost is not None:
            raise DeviceLost(f"synchronize on a lost device: {self.lost}")

    def hold(self, stream) -> None:
        """Run nothing of ``stream`` in :meth:`run_some` until released."""
        stream.held = True

    def release(self, stream) -> None:
        stream.held = False

    def run_some(self, n: int | None = None) -> int:
        """Run up to ``n`` (None: all that can run) queued operations, each
        time from a stream picked at random among those not held whose next
        operation can run. Returns how many ran."""
        done = 0
        while n is None or done < n:
            ready = [s for s in self.streams if not s.held and self.runnable(s)]
            if not ready:
                break
            self.run_one(self.rng.choice(ready))
            done += 1
        return done
