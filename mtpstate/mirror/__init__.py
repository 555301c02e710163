"""Device mirror: each step's changes reach torch tensors in one replay.

The host arrays stay the source of truth. The step kernels append every
element they change, as (flat position, value), to a pinned staging slot;
new requests' token ids go to the slot's token area (``_kernels/tokens.py``).
``end_step`` ships the slot: on CUDA by replaying, on the consumer's stream,
a CUDA graph captured once per slot, size bucket and kind of step, which
copies the slot (positions int64, values int32: 12 bytes per changed
element, padded to the bucket) and scatters it into a single flat int32
tensor of which every device tensor is a view; the same replay scatters the
token area into the token target, copies the step's batch ``idx_mapping``
and zeroes new rows of engine tensors, when asked to. Then one event, made
once per slot, is recorded: the slot is refilled only after it completed
(refilling a pinned buffer while a copy still reads it silently corrupts the
device data). The host waits only when the ring is full.

Everything is sized when the table is built: a slot holds what any one step
can stage apart from token ids (every row added and updated, with full block
tables), its token area ``token_chunk`` token ids; the token ids of a step
that adds more go in further chunks through a ring of their own, one replay
each. Nothing grows, and no graph is captured, while serving.

Where no graph can be captured the same work is issued eagerly (views made
once, on the consumer's stream); on the CPU the host runs it. A step's
device work is a list of operations issued in order; if one fails, those
not yet queued are kept and issued by the next call (after it has waited for
the device and rewritten every region the host holds), so no operation runs
twice. A device that fails to synchronize is unusable (a sticky error): every
later call says so.

Every device operation goes through a :class:`mtpstate.devices.DeviceOps`:
CUDA, the CPU, or, in tests, a deferred model of a GPU's asynchrony, on
which CI checks the ordering, the operation counts, the capture rules and
the fault handling.
"""

from mtpstate.mirror.device_mirror import DeviceMirror
from mtpstate.mirror.layout import MIRRORED_FIELDS, step_capacity

__all__ = ["DeviceMirror", "MIRRORED_FIELDS", "step_capacity"]
