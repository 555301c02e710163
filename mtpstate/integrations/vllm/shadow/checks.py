"""The shadow's comparisons, vLLM's runner against mtpstate's, by request
id: rows differ between the two (each side keeps its own), so each side's
rows of the live ids are gathered and compared as whole arrays, and only a
difference is looked at per request.

Host arrays are compared with numpy after each step. Device tensors are
compared by torch ops enqueued on the current stream (after vLLM's writes of
the step) into a few numbers per field, copied back without blocking and
read once they have arrived (:class:`DeviceCheck`)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Disagreement:
    """One value that differs: where (a request id, or None for the batch),
    the field, vLLM's value and mtpstate's."""

    req_id: str | None
    field: str
    vllm: object
    mtpstate: object

    def full(self) -> str:
        where = "the batch" if self.req_id is None else f"request {self.req_id!r}"
        return f"{where}, {self.field}: vLLM {self.vllm!r}, mtpstate {self.mtpstate!r}"

    def __str__(self) -> str:
        where = "" if self.req_id is None else f"{self.req_id!r}."
        return f"{where}{self.field}: vLLM {str(self.vllm)[:60]} vs {str(self.mtpstate)[:60]}"


@dataclasses.dataclass
class Rows:
    """The live request ids (vLLM's order) and each side's rows of them."""

    ids: list
    vllm: np.ndarray  # [n] vLLM's rows
    mtpstate: np.ndarray  # [n] mtpstate's rows

    @classmethod
    def of(cls, vllm_index: dict, mtpstate_index: dict, ids=None) -> Rows:
        """``ids`` (default: every live id) through both sides' id -> row maps."""
        ids = list(vllm_index if ids is None else ids)
        n = len(ids)
        return cls(
            ids,
            np.fromiter(map(vllm_index.__getitem__, ids), np.intp, n),
            np.fromiter(map(mtpstate_index.__getitem__, ids), np.intp, n),
        )

    def row_map(self, size: int) -> np.ndarray:
        """``[size]``: vLLM's row -> mtpstate's row of the same id (-1: none)."""
        m = np.full(size, -1, np.int64)
        m[self.vllm] = self.mtpstate
        return m


def same_ids(out: list, vllm_index: dict, mtpstate_index: dict) -> bool:
    """Whether both sides hold the same live request ids (else one
    disagreement naming those held by one side only)."""
    if vllm_index.keys() == mtpstate_index.keys():
        return True
    only_v = sorted(vllm_index.keys() - mtpstate_index.keys())[:8]
    only_m = sorted(mtpstate_index.keys() - vllm_index.keys())[:8]
    out.append(Disagreement(None, "live request ids (held by one side only)", only_v, only_m))
    return False


def rows_equal(out: list, name: str, a: np.ndarray, b: np.ndarray, rows: Rows) -> int:
    """``a`` (vLLM's ``[max_num_reqs]``) against ``b`` (mtpstate's) at the
    rows of each id; the first id that differs into ``out``. Returns the
    number of values compared."""
    x, y = a[rows.vllm], b[rows.mtpstate]
    if not np.array_equal(x, y):
        i = int(np.flatnonzero(x != y)[0])
        out.append(Disagreement(rows.ids[i], name, x[i].item(), y[i].item()))
    return len(rows.ids)


def values_equal(out: list, name: str, a, b) -> int:
    """Two batch values (arrays by dtype and values; the rest by ``==``)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
        )
        n = getattr(a, "size", 1)
    else:
        same, n = a == b and type(a) is type(b), 1
    if not same:
        out.append(Disagreement(None, name, _short(a), _short(b)))
    return n


def _short(v):
    if isinstance(v, np.ndarray):
        return f"{v.dtype}{list(v.shape)} {v.tolist()[:16]}"
    return v


def upload(rows: np.ndarray, device, keep: list):
    """``rows`` as an int64 tensor on ``device``: on a GPU, a non-blocking
    copy from pinned memory, which ``keep`` holds until the copy is done."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    if torch.device(device).type != "cuda":
        return t
    t = t.pin_memory()
    keep.append(t)
    return t.to(device, non_blocking=True)


class DeviceCheck:
    """Device tensors compared on the current stream: per field, how many
    values differ, the first that does, and both values there, computed
    on the device and copied back without blocking the host.

    Parameters
    ----------
    step
        The step whose tensors these are (named in a disagreement).
    """

    def __init__(self, step: int, device):
        import torch

        self._torch = torch
        self.step = step
        self.device = device
        self._cuda = torch.device(device).type == "cuda"
        self._fields: list = []  # (name, ids or None, width)
        self._stats: list = []
        self._keep: list = []  # host buffers of in-flight uploads
        self.values = 0
        self._host = None
        self._event = None

    def index(self, rows: np.ndarray):
        """``rows`` as an int64 index tensor on the device (a non-blocking
        upload where the device is a GPU)."""
        return upload(rows, self.device, self._keep)

    def add(self, name: str, a, b, ids=None, mask=None) -> None:
        """vLLM's ``a`` against mtpstate's ``b`` (the same shape: ``[n]`` or
        ``[n, w]``; ``mask``: where the values count; ``ids``: the request
        of each of the ``n`` rows, None for batch-level values)."""
        torch = self._torch
        if a.numel() == 0:
            return
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            self._fields.append((name + " (dtype, shape)", None, 1))
            self._stats.append(
                torch.tensor([1.0, 0.0, float("nan"), float("nan")], dtype=torch.float64, device=a.device)
            )
            return
        differs = a != b
        if mask is not None:
            differs &= mask
        flat = differs.reshape(-1)
        first = flat.to(torch.uint8).argmax()
        va, vb = a.reshape(-1)[first], b.reshape(-1)[first]
        self._stats.append(torch.stack([flat.sum().double(), first.double(), va.double(), vb.double()]))
        width = a.shape[1] if a.dim() == 2 else 1
        self._fields.append((name, ids, width))
        self.values += a.numel()

    def launch(self) -> None:
        """Copy the results back (no blocking; :meth:`ready` tells when they are in)."""
        torch = self._torch
        if not self._stats:
            return
        stats = torch.stack(self._stats)  # [fields, 4]: differing, first, vLLM's, mtpstate's
        self._stats = []
        if self._cuda:
            self._host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            self._host.copy_(stats, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = stats

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def disagreements(self) -> list[Disagreement]:
        """Once :meth:`ready`: one disagreement per field that differs."""
        out = []
        if self._host is None:
            return out
        for (name, ids, width), (n, first, va, vb) in zip(self._fields, self._host.tolist()):
            if n == 0:
                continue
            i, col = divmod(int(first), width)
            where = None if ids is None else ids[i]
            if ids is None:  # (a batch-level tensor: its flat index)
                field = f"{name}[{int(first)}]"
            else:
                field = f"{name}[{col}]" if width > 1 else name
            out.append(Disagreement(where, f"{field} (device, step {self.step})", _num(va), _num(vb)))
        return out


def _num(v: float):
    return int(v) if v == v and float(v).is_integer() else v
