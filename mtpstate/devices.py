"""The device operations the mirror issues, behind one small interface.

The mirror's per-step device work is five kinds of operation: allocate
(pinned host staging, device buffers), copy host -> device (non-blocking),
scatter (``index_copy_``), record an event / wait on it from the host, and
order one stream after another. Three implementations:

- :class:`CudaOps`: torch on a CUDA device (the real thing);
- :class:`ImmediateOps`: torch on the CPU, every operation run by the host
  when issued (no streams, no events);
- :class:`DeferredOps`: a model of a GPU's asynchrony for tests. Copies and
  scatters are queued on a stream and run later, in stream order, reading
  their source when they run, not when issued; an event completes only when
  the work queued before it has run; a stream wait holds the waiting
  stream's later work until the other stream has reached the point of the
  wait; of several writes of a scatter to one element, the first wins (on a
  GPU which one wins is undefined). Tests can hold a stream back and run the queued work in any legal
  order, which is how CI checks the ordering that only a GPU would
  otherwise exercise.
"""

from __future__ import annotations

import contextlib
import random

__all__ = ["CudaOps", "DeferredOps", "DeviceOps", "ImmediateOps", "ops_for"]


class DeviceOps:
    """What the mirror needs from a device. ``asynchronous``: device work may
    still be pending when the host goes on (so host writes into memory the
    device reads are a hazard)."""

    asynchronous = False

    def __init__(self, torch, device):
        self.torch = torch
        self.device = torch.device(device)

    # allocation
    def pinned_empty(self, n: int, dtype):
        return self.torch.empty(n, dtype=dtype)

    def empty(self, n: int, dtype):
        return self.torch.empty(n, dtype=dtype, device=self.device)

    # streams and events
    def new_stream(self):
        return None

    def current_stream(self):
        return None

    def on_stream(self, stream):
        return contextlib.nullcontext()

    def wait_stream(self, waiter, waitee) -> None:
        """``waiter``'s work issued from now on runs after the work queued
        on ``waitee`` so far."""

    def record_event(self, stream):
        return None

    def host_wait(self, event) -> None:
        """Block the host until ``event`` has completed."""

    def synchronize(self) -> None:
        """Block the host until every queued operation has run."""

    # work, queued on the current stream
    def copy(self, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def scatter(self, target, positions, values) -> None:
        target.index_copy_(0, positions, values)


class ImmediateOps(DeviceOps):
    """torch on the CPU: the host runs every operation as it is issued."""


class CudaOps(DeviceOps):
    """torch on a CUDA device: pinned staging, streams, events."""

    asynchronous = True

    def pinned_empty(self, n, dtype):
        return self.torch.empty(n, dtype=dtype, pin_memory=True)

    def new_stream(self):
        return self.torch.cuda.Stream(device=self.device)

    def current_stream(self):
        # the mirror's device, which need not be the current device
        return self.torch.cuda.current_stream(self.device)

    def on_stream(self, stream):
        return self.torch.cuda.stream(stream)

    def wait_stream(self, waiter, waitee):
        waiter.wait_stream(waitee)

    def record_event(self, stream):
        ev = self.torch.cuda.Event()
        ev.record(stream)
        return ev

    def host_wait(self, event):
        event.synchronize()

    def synchronize(self):
        self.torch.cuda.synchronize(self.device)


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
    def __init__(self, stream: _Stream):
        self.stream = stream
        self.at = stream.issued  # complete once the stream has run this many

    @property
    def done(self) -> bool:
        return self.stream.ran >= self.at


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
    """

    asynchronous = True

    def __init__(self, torch, seed: int = 0):
        super().__init__(torch, "cpu")
        self.default = _Stream("default")  # the consumer's (model's) stream
        self.streams = [self.default]
        self._current = self.default
        self.rng = random.Random(seed)
        self.ops_run = 0

    def new_stream(self):
        s = _Stream(f"side{len(self.streams)}")
        self.streams.append(s)
        return s

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
        tensor) on ``stream`` (default: the current one)."""
        self._enqueue(stream or self._current, "run", fn)

    def wait_stream(self, waiter, waitee):
        self._enqueue(waiter, "wait", _Event(waitee))

    def record_event(self, stream):
        return _Event(stream)

    def copy(self, dst, src):
        self._enqueue(self._current, "run", lambda: dst.copy_(src))  # reads src when it runs

    def scatter(self, target, positions, values):
        # which of several writes to one position wins is undefined on a GPU:
        # here the first, the opposite of a sequential loop
        self._enqueue(self._current, "run", lambda: target.index_copy_(0, positions.flip(0), values.flip(0)))

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
        self._run_until(event)

    def synchronize(self):
        for s in self.streams:
            self._run_until(_Event(s))

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
