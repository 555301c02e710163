"""Trace files: a run's scheduler outputs, recorded once and replayed so that
every implementation and every run sees identical steps.

Format (little-endian): the magic ``b"MTPTRACE"``, a uint32 format version,
a uint64 header length, a UTF-8 JSON header (simulator config, step count,
and the name, dtype, shape and byte offset of every array), the arrays'
bytes, and a CRC-32 of everything before it. Steps are stored as columns:
request ids once, in a string table; every per-step list as CSR offsets plus
values. ``load`` checks magic, version, size and checksum, and says which
one failed.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict

import numpy as np

from mtpstate.errors import StateError
from mtpstate.tools.sim import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, SimConfig

__all__ = ["TraceError", "save", "load", "Trace"]

MAGIC = b"MTPTRACE"
VERSION = 1
_PREFIX = struct.Struct("<8sIQ")


class TraceError(StateError):
    """A file that is not a valid mtpstate trace (foreign, truncated, corrupt,
    or of an unsupported version)."""


class Trace:
    """A loaded trace: ``steps`` (SchedulerOutput objects), ``truth`` (per
    step, the scheduler's num_computed_tokens of each scheduled request) and
    ``config`` (the simulator's, as a dict)."""

    def __init__(self, steps, truth, config):
        self.steps = steps
        self.truth = truth
        self.config = config

    def __len__(self):
        return len(self.steps)


class _Ragged:
    """A list of lists as CSR offsets + values."""

    def __init__(self):
        self.offsets = [0]
        self.values: list = []

    def add(self, items):
        self.values.extend(items)
        self.offsets.append(len(self.values))

    def arrays(self, dtype):
        return np.asarray(self.offsets, np.int64), np.asarray(self.values, dtype)


def _encode(steps, truth, ng):
    ids: dict[str, int] = {}

    def rid(r):
        i = ids.get(r)
        if i is None:
            i = ids[r] = len(ids)
        return i

    cols = {
        name: _Ragged()
        for name in ("fin", "pre", "new", "cached", "sched_id", "sched_n", "spec_id", "truth_id", "truth_n")
    }
    pre_none, total = [], []
    new_cols = {k: [] for k in ("id", "nct", "max_tokens", "has_prefill")}
    new_prompt, new_prefill, spec_tok = _Ragged(), _Ragged(), _Ragged()
    new_blocks = [_Ragged() for _ in range(ng)]
    c_cols = {k: [] for k in ("id", "nct", "nout", "has_blocks", "resumed")}
    c_blocks = [_Ragged() for _ in range(ng)]
    c_newtok = _Ragged()
    for so, tr in zip(steps, truth):
        cols["fin"].add(sorted(rid(r) for r in so.finished_req_ids))
        pre_none.append(so.preempted_req_ids is None)
        cols["pre"].add(sorted(rid(r) for r in (so.preempted_req_ids or ())))
        total.append(so.total_num_scheduled_tokens)
        cols["new"].add(range(len(new_cols["id"]), len(new_cols["id"]) + len(so.scheduled_new_reqs)))
        for r in so.scheduled_new_reqs:
            new_cols["id"].append(rid(r.req_id))
            new_cols["nct"].append(r.num_computed_tokens)
            sp = r.sampling_params
            new_cols["max_tokens"].append(-2 if sp is None else (-1 if sp.max_tokens is None else sp.max_tokens))
            new_prompt.add(r.prompt_token_ids)
            new_cols["has_prefill"].append(r.prefill_token_ids is not None)
            new_prefill.add(r.prefill_token_ids or ())
            for g in range(ng):
                new_blocks[g].add(r.block_ids[g])
        c = so.scheduled_cached_reqs
        cols["cached"].add(range(len(c_cols["id"]), len(c_cols["id"]) + len(c.req_ids)))
        for i, r in enumerate(c.req_ids):
            c_cols["id"].append(rid(r))
            c_cols["nct"].append(c.num_computed_tokens[i])
            c_cols["nout"].append(c.num_output_tokens[i] if i < len(c.num_output_tokens) else 0)
            b = c.new_block_ids[i]
            c_cols["has_blocks"].append(b is not None)
            c_cols["resumed"].append(r in c.resumed_req_ids)
            for g in range(ng):
                c_blocks[g].add(b[g] if b is not None else ())
            c_newtok.add(c.new_token_ids[i] if i < len(c.new_token_ids) else ())
        cols["sched_id"].add([rid(r) for r in so.num_scheduled_tokens])
        cols["sched_n"].add(list(so.num_scheduled_tokens.values()))
        cols["spec_id"].add([rid(r) for r in so.scheduled_spec_decode_tokens])
        for toks in so.scheduled_spec_decode_tokens.values():
            spec_tok.add(toks)
        cols["truth_id"].add([rid(r) for r in tr])
        cols["truth_n"].add(list(tr.values()))
    arrays = {}
    blob = "\0".join(ids).encode("utf-8", "surrogatepass")
    arrays["id_blob"] = np.frombuffer(blob, np.uint8)
    arrays["id_len"] = np.fromiter((len(r.encode("utf-8", "surrogatepass")) for r in ids), np.int64, len(ids))
    for name, rag in cols.items():
        arrays[name + "_off"], arrays[name] = rag.arrays(np.int64)
    arrays["pre_none"] = np.asarray(pre_none, np.bool_)
    arrays["total"] = np.asarray(total, np.int64)
    for k, v in new_cols.items():
        arrays["new_" + k] = np.asarray(v, np.int64)
    for k, v in c_cols.items():
        arrays["c_" + k] = np.asarray(v, np.int64)
    for name, rag in (
        ("new_prompt", new_prompt),
        ("new_prefill", new_prefill),
        ("spec_tok", spec_tok),
        ("c_newtok", c_newtok),
    ):
        arrays[name + "_off"], arrays[name] = rag.arrays(np.int64)
    for g in range(ng):
        arrays[f"new_blocks{g}_off"], arrays[f"new_blocks{g}"] = new_blocks[g].arrays(np.int64)
        arrays[f"c_blocks{g}_off"], arrays[f"c_blocks{g}"] = c_blocks[g].arrays(np.int64)
    # store each column in the narrowest integer type that holds it
    for k, a in arrays.items():
        if a.dtype == np.int64 and a.size and a.min() >= -(2**31) and a.max() < 2**31:
            arrays[k] = a.astype(np.int32)
    return arrays


def save(path, steps, truth, config: SimConfig | dict, num_groups: int | None = None) -> int:
    """Write ``steps`` (and the per-step ``truth``) to ``path``; returns bytes written."""
    steps = list(steps)
    truth = list(truth)
    if len(truth) != len(steps):
        raise ValueError("one truth dict per step")
    cfg = asdict(config) if isinstance(config, SimConfig) else dict(config)
    ng = num_groups or len(cfg.get("block_sizes", (16,)))
    arrays = _encode(steps, truth, ng)
    specs, chunks, off = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        specs.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": off})
        chunks.append(a.tobytes())
        off += a.nbytes
    header = json.dumps(
        {"steps": len(steps), "num_groups": ng, "config": cfg, "arrays": specs, "data_bytes": off}
    ).encode()
    body = _PREFIX.pack(MAGIC, VERSION, len(header)) + header + b"".join(chunks)
    with open(path, "wb") as f:
        f.write(body)
        f.write(struct.pack("<I", zlib.crc32(body)))
    return len(body) + 4


def _read(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < _PREFIX.size or raw[:8] != MAGIC:
        raise TraceError(f"{path}: not an mtpstate trace (bad magic)")
    magic, version, hlen = _PREFIX.unpack_from(raw)
    if version != VERSION:
        raise TraceError(f"{path}: trace format version {version}, this mtpstate reads version {VERSION}")
    if len(raw) < _PREFIX.size + hlen + 4:
        raise TraceError(f"{path}: truncated trace (header cut short)")
    try:
        header = json.loads(raw[_PREFIX.size : _PREFIX.size + hlen])
    except ValueError as e:
        raise TraceError(f"{path}: corrupt trace header ({e})") from None
    data_start = _PREFIX.size + hlen
    expect = data_start + header["data_bytes"] + 4
    if len(raw) != expect:
        what = "truncated" if len(raw) < expect else "oversized"
        raise TraceError(f"{path}: {what} trace ({len(raw)} bytes, header says {expect})")
    (crc,) = struct.unpack_from("<I", raw, len(raw) - 4)
    if zlib.crc32(raw[:-4]) != crc:
        raise TraceError(f"{path}: corrupt trace (checksum mismatch)")
    arrays = {}
    for spec in header["arrays"]:
        dt = np.dtype(spec["dtype"])
        n = int(np.prod(spec["shape"])) if spec["shape"] else 1
        start = data_start + spec["offset"]
        arrays[spec["name"]] = np.frombuffer(raw, dt, n, start).reshape(spec["shape"])
    return header, arrays


def load(path) -> Trace:
    """Read a trace written by :func:`save`."""
    header, a = _read(path)
    ng = header["num_groups"]
    blob = a["id_blob"].tobytes()
    ids, pos = [], 0
    for n in a["id_len"].tolist():
        ids.append(blob[pos : pos + n].decode("utf-8", "surrogatepass"))
        pos += n + 1

    def rag(name, i):
        off = a[name + "_off"]
        return a[name][off[i] : off[i + 1]].tolist()

    steps, truth = [], []
    for s in range(header["steps"]):
        so = SchedulerOutput()
        so.finished_req_ids = {ids[i] for i in rag("fin", s)}
        so.preempted_req_ids = None if a["pre_none"][s] else {ids[i] for i in rag("pre", s)}
        so.total_num_scheduled_tokens = int(a["total"][s])
        for k in rag("new", s):
            mt = int(a["new_max_tokens"][k])
            so.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=ids[a["new_id"][k]],
                    prompt_token_ids=rag("new_prompt", k),
                    sampling_params=None if mt == -2 else SamplingParams(None if mt == -1 else mt),
                    block_ids=tuple(rag(f"new_blocks{g}", k) for g in range(ng)),
                    num_computed_tokens=int(a["new_nct"][k]),
                    prefill_token_ids=rag("new_prefill", k) if a["new_has_prefill"][k] else None,
                )
            )
        c = CachedRequestData()
        for k in rag("cached", s):
            r = ids[a["c_id"][k]]
            c.req_ids.append(r)
            c.num_computed_tokens.append(int(a["c_nct"][k]))
            c.num_output_tokens.append(int(a["c_nout"][k]))
            c.new_block_ids.append(tuple(rag(f"c_blocks{g}", k) for g in range(ng)) if a["c_has_blocks"][k] else None)
            c.new_token_ids.append(rag("c_newtok", k))
            if a["c_resumed"][k]:
                c.resumed_req_ids.add(r)
        so.scheduled_cached_reqs = c
        so.num_scheduled_tokens = dict(zip((ids[i] for i in rag("sched_id", s)), rag("sched_n", s)))
        spec_ids = rag("spec_id", s)
        spec_base = a["spec_id_off"][s]
        so.scheduled_spec_decode_tokens = {ids[r]: rag("spec_tok", spec_base + j) for j, r in enumerate(spec_ids)}
        steps.append(so)
        truth.append(dict(zip((ids[i] for i in rag("truth_id", s)), rag("truth_n", s))))
    return Trace(steps, truth, header["config"])


def record(config: SimConfig, steps: int, path, progress=None) -> Trace:
    """Run the simulator for ``steps`` steps and save the trace."""
    from mtpstate.tools.sim import Simulator

    sim = Simulator(config)
    outs, truth = [], []
    for i in range(steps):
        outs.append(sim.step())
        truth.append(dict(sim.truth))
        if progress is not None:
            progress(i + 1, steps)
    save(path, outs, truth, config)
    return Trace(outs, truth, asdict(config))
