"""Trace format v1: a directory of three Parquet tables and ``meta.json``.

See ``docs/trace-format.md`` for every column and its unit. This module reads, writes
and validates traces and computes the baseline memory timeline; it never imports torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..base.atomic import check_output, replace_dir_atomic
from ..base.errors import TraceError

FORMAT_VERSION = 20
# v1 lacks meta.model_calls and meta.loop: plans of it cannot be applied; v3 adds meta.gpu_kernels,
# the sharding kinds below and meta.fsdp (docs/sharding.md); v4 adds meta.random_ops (the ops that
# drew random numbers; older traces are read by op name), meta.python_refs (record/pyrefs.py), and for
# DDP traces the kind ddp_bucket and meta.ddp; v5 adds meta.runtime_overhead's partition terms
# (checkpoint_op_s, chunk_op_s: runtime/calibrate/rates.py; older traces cost a chunk by launch overhead);
# v6 adds meta.runtime_overhead.span_costs (a head + loss over tokens measured chunked) and unfloored;
# v7 adds meta.runtime_overhead.checkpoint_call_s (one torch.utils.checkpoint call's own cost);
# v8 adds meta.forward_in_backward (module forwards the model itself re-runs in backward); v9 adds
# meta.backward_nodes (where each autograd node starts in backward: where it unpacks saved tensors);
# v10 adds meta.module_args (each module's forward calls, with their tensor arguments); v11 adds
# meta.data_sized (tensors whose sizes depend on tensor values: a mixture of experts' routed tokens);
# v12 adds meta.model_calls[].trainable; v13 measures meta.runtime_overhead.span_costs on the span's
# own stretch of the step, at every chunk choice up to 32 (the probed span costs what was measured);
# v14 measures a head over tokens as replay now runs it, loss and gradients in one fused forward
# pass (span_costs.tokens.fused; its extra_s may be below 0); older measurements are not used;
# v15 adds the end of each module call to meta.module_args (where replay's planned regions end);
# v16 adds meta.fsdp.units[].param_dtype/reduce_dtype (FSDP2's MixedPrecisionPolicy as it runs);
# v17 lets meta.fsdp.units[].reshard_after_forward be an int (the ranks FSDP2 reshards to after
# forward) and adds the kind post_forward_shard (the shards it keeps there); v18 adds
# meta.runtime_overhead.region_s (one planned region entered) and measures module_call_s on the
# model's own call (runtime/calibrate/rates.py module_hook_rates); older traces charge regions nothing
# v19 adds meta.runtime_overhead.region_op_s, per op of a planned region what the regions cost
# the forward beyond the runtime's own seconds (runtime/calibrate/rates.py region_outside)
# v20 measures module_call_s whole: the module hooks alone unclocked against the call plain, per
# module call (meta.runtime_overhead.module_call_probe; runtime/calibrate/rates.py module_hook_rates), where
# v18-v19 took the hooks' own seconds; region_op_s is net of it
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20)
PHASES = ("forward", "backward", "optimizer", "other")


def backward_node_starts(meta: dict, phase) -> np.ndarray | None:
    """Per op of a trace with ``meta["backward_nodes"]`` (trace v9: op ids where backward
    starts running another autograd node) and phases ``phase``: the first op of its node for
    a backward op, -1 for any other op; None when the trace lists no node starts. A node's
    ops are contiguous backward ops, so one that follows a non-backward op starts its own."""
    starts = meta.get("backward_nodes")
    phase = np.asarray(phase)
    n = len(phase)
    if not starts or n == 0:
        return None
    s = np.asarray(sorted(int(x) for x in starts), dtype=np.int64)
    ops = np.arange(n, dtype=np.int64)
    k = np.searchsorted(s, ops, side="right") - 1
    start = np.where(k >= 0, s[np.maximum(k, 0)], ops)
    backward = phase == "backward"
    prev_other = np.maximum.accumulate(np.where(~backward, ops, -1))
    return np.where(backward, np.maximum(start, prev_other + 1), -1)


def renumber_tensors(tensors, alloc, producer, free):
    """A view's tensor table as a recording numbers it: ``tensors``' rows with their new op ids
    (``alloc``, ``producer``, ``free``, one per row), ordered and given ids by allocation (rows
    allocated before the step first; ties keep their order). Returns (the table, each row's new
    id)."""
    alloc, producer, free = (np.asarray(x, dtype=np.int64) for x in (alloc, producer, free))
    order = np.argsort(np.where(alloc < 0, -1, alloc), kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    out = tensors.iloc[order].copy()
    out["tensor_id"] = np.arange(len(out), dtype=np.int64)
    out["alloc_op"] = alloc[order].astype(np.int32)
    out["producer_op"] = producer[order].astype(np.int32)
    out["free_op"] = free[order].astype(np.int32)
    return out.reset_index(drop=True), rank


def remap_backward_nodes(meta: dict, phase, order) -> None:
    """Rewrite ``meta["backward_nodes"]`` for a view whose ops are the recorded ops ``order``
    (recorded op ids, in the view's order; ops left out are gone), ``phase`` the recorded ops'
    phases: each op keeps its node (:func:`backward_node_starts`), and a node starts in the
    view wherever an op's node differs from the op's before it (an op outside backward
    belongs to none)."""
    node = backward_node_starts(meta, phase)
    if node is None:
        return
    phase = np.asarray(phase)
    ops = np.arange(len(phase), dtype=np.int64)
    node = np.where(node >= 0, node, -2 - ops)  # outside backward: a node of its own
    seq = node[np.asarray(order, dtype=np.int64)]
    keep = np.ones(len(seq), dtype=bool)
    keep[1:] = seq[1:] != seq[:-1]
    meta["backward_nodes"] = [int(i) for i in np.nonzero(keep)[0].tolist()
                              if phase[int(order[i])] == "backward"]


def rerun_where(info: dict) -> str:
    """Where ``meta.forward_in_backward`` says the re-runs ran: the first modules, or the model."""
    mods = list(info.get("modules") or [])
    if not mods:
        return "forward code of the model"
    more = f" and {len(mods) - 3} more" if len(mods) > 3 else ""
    return f"the forward of {len(mods)} module(s) ({', '.join(mods[:3])}{more})"


def own_checkpointing(meta: dict) -> str | None:
    """A sentence on the model's own activation checkpointing (``meta.forward_in_backward``,
    trace v8: module forwards re-run inside backward, counted by the recorder), or None when
    the model re-ran none (or the trace predates v8)."""
    info = meta.get("forward_in_backward") or {}
    n = int(info.get("ops") or 0)
    if not n:
        return None
    return (f"The model checkpoints itself: {n} ops of its backward re-run {rerun_where(info)}, as "
            "torch.utils.checkpoint or a transformers model's "
            "gradient_checkpointing_enable() does. A plan cannot change those re-runs, and they hold every "
            "activation of a module at once in backward: turn the model's own checkpointing off "
            "(model.gradient_checkpointing_disable(), or remove its torch.utils.checkpoint calls) and record "
            "again, so that the plan chooses what to recompute.")
def data_sized_note(meta: dict) -> str | None:
    """A sentence on the tensors whose sizes depend on tensor values (trace v11
    ``meta.data_sized``), or None when the step has none (or the trace predates v11)."""
    info = meta.get("data_sized") or {}
    if not info.get("tensors"):
        return None
    src = info.get("sources") or []
    where = "; ".join(f"{op} in {module or '<top level>'}, {n} call(s)" for op, module, n in src[:3])
    more = f"; and {len(src) - 3} more" if len(src) > 3 else ""
    return (f"{len(info['tensors'])} tensors of the step have sizes set by tensor values ({where}{more}), as the "
            "tokens a mixture of experts routes to each expert, or the labels a mask keeps, are: plans run on steps "
            "whose sizes differ (the runtime rebuilds "
            "such a tensor at its live size), but the peak is predicted at the recorded sizes, and another batch "
            "can peak a few percent higher. Solve for a budget below the device's memory by that much.")


KINDS = ("parameter", "buffer", "gradient", "optimizer_state", "activation", "input", "temporary",
         "unsharded_parameter", "unsharded_gradient", "all_gather", "reduce_scatter", "ddp_bucket",
         "post_forward_shard")
ROLES = ("read", "write")
COST_SOURCES = ("measured", "estimated", "imported")

OPS_SCHEMA = pa.schema(
    [
        ("op_id", pa.int32()),
        ("step", pa.int32()),
        ("phase", pa.string()),
        ("op", pa.string()),
        ("module", pa.string()),
        ("duration_s", pa.float64()),
        ("flops", pa.int64()),
        ("cost_source", pa.string()),
        ("recomputable", pa.bool_()),
        ("mutates", pa.bool_()),
    ]
)
TENSORS_SCHEMA = pa.schema(
    [
        ("tensor_id", pa.int64()),
        ("nbytes", pa.int64()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("kind", pa.string()),
        ("producer_op", pa.int32()),
        ("alloc_op", pa.int32()),
        ("free_op", pa.int32()),
    ]
)
ACCESSES_SCHEMA = pa.schema(
    [
        ("op_id", pa.int32()),
        ("tensor_id", pa.int64()),
        ("role", pa.string()),
        ("arg_index", pa.int32()),
    ]
)
TABLES = {"ops": OPS_SCHEMA, "tensors": TENSORS_SCHEMA, "accesses": ACCESSES_SCHEMA}
TRACE_FILES = frozenset({"meta.json", *(f"{name}.parquet" for name in TABLES)})  # all a trace directory holds
_CATEGORIES = {
    ("ops", "phase"): PHASES,
    ("ops", "cost_source"): COST_SOURCES,
    ("tensors", "kind"): KINDS,
    ("accesses", "role"): ROLES,
}


@dataclass
class Trace:
    """One recorded (or imported) training step.

    ``ops``, ``tensors`` and ``accesses`` are DataFrames with the columns of the schemas
    above; ``meta`` is the parsed ``meta.json``; ``path`` is where it was read from.
    """

    ops: pd.DataFrame
    tensors: pd.DataFrame
    accesses: pd.DataFrame
    meta: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def name(self) -> str:
        return self.meta.get("name") or (self.path.name if self.path else "trace")

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def cost_unit(self) -> str:
        """``s`` for recorded traces; ``units`` for imported graphs (abstract compute cost)."""
        return self.meta.get("cost_unit", "s")

    def content_hash(self, schema_metadata: dict | None = None) -> str:
        """sha256 over the three tables' contents (not file bytes, so re-writing keeps it), without
        the schema metadata pyarrow attaches from pandas: it names the pandas version, so a pandas
        upgrade (3.1.1 to 3.1.2) changed the hash of every trace, and each one failed its check
        as if edited. ``schema_metadata``: per table, the metadata to hash with instead (a trace
        written before this: :func:`read_trace` checks it with its files' own)."""
        h = hashlib.sha256()
        for name, schema in TABLES.items():
            table = pa.Table.from_pandas(getattr(self, name), schema=schema, preserve_index=False)
            table = table.replace_schema_metadata((schema_metadata or {}).get(name))
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
            h.update(name.encode())
            h.update(sink.getvalue().to_pybytes())
        return h.hexdigest()

    def signature(self) -> str:
        """The steady-state step's op-sequence signature (from meta, else computed from names)."""
        sig = self.meta.get("signature")
        if sig:
            return sig
        return op_signature(self.ops["op"].tolist())


def op_signature(op_names: list[str], shapes: list | None = None) -> str:
    """Hash of the op sequence (names and, when given, shapes): equal steps, equal signatures."""
    h = hashlib.sha256()
    for i, name in enumerate(op_names):
        h.update(name.encode())
        if shapes is not None:
            h.update(repr(shapes[i]).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------


def frame(table: str, rows: dict[str, list] | pd.DataFrame) -> pd.DataFrame:
    """A DataFrame with exactly ``table``'s columns, in order, cast to the schema's types."""
    schema = TABLES[table]
    columns = rows.columns if isinstance(rows, pd.DataFrame) else rows.keys()
    missing = [f.name for f in schema if f.name not in columns]
    if missing:
        raise TraceError(f"Cannot build the {table} table: columns {missing} are missing.")
    if isinstance(rows, pd.DataFrame):
        t = pa.Table.from_pandas(rows[[f.name for f in schema]], schema=schema, preserve_index=False)
    else:
        t = pa.Table.from_pydict({f.name: list(rows[f.name]) for f in schema}, schema=schema)
    return _to_pandas(t)


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    df = table.to_pandas()
    for f in table.schema:
        if pa.types.is_string(f.type) or pa.types.is_large_string(f.type):
            df[f.name] = df[f.name].astype(object)
    return df


# ---------------------------------------------------------------------------------------------
# Writing and reading
# ---------------------------------------------------------------------------------------------


def check_trace_output(path: str | Path, force: bool, option: str | None = None) -> Path:
    """Check, before any work, that a trace can be written to the directory ``path``: an
    existing directory is replaced only with ``force`` and only if it holds nothing but a
    trace's own files (:data:`TRACE_FILES`); see :func:`taichi_plan.base.atomic.check_output`."""
    return check_output(path, force, what="trace directory", option=option, dir_files=TRACE_FILES)


def write_trace(trace: Trace, path: str | Path, force: bool = False) -> Path:
    """Validate and write ``trace`` to the directory ``path`` atomically (missing parent
    directories are created). ``force`` replaces an existing trace, never anything else."""
    target = check_trace_output(path, force)
    validate(trace)
    meta = dict(trace.meta)
    meta["format_version"] = FORMAT_VERSION
    meta.setdefault("name", target.name)
    meta["num_ops"] = int(len(trace.ops))
    meta["num_tensors"] = int(len(trace.tensors))
    meta["content_hash"] = trace.content_hash()

    def build(tmp: Path) -> None:
        for name, schema in TABLES.items():
            table = pa.Table.from_pandas(getattr(trace, name), schema=schema, preserve_index=False)
            pq.write_table(table, tmp / f"{name}.parquet")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")

    replace_dir_atomic(build, target, what="trace directory")
    trace.meta = meta
    trace.path = target
    return target


def read_trace(path: str | Path) -> Trace:
    """Read and validate a trace directory; every problem is a :class:`TraceError`."""
    p = Path(path)
    hint = "Record it again with `taichi-plan record` or import it with `taichi-plan import-graph`."
    if not p.exists():
        raise TraceError(f"Trace {str(p)!r} does not exist. {hint}")
    if not p.is_dir():
        raise TraceError(f"Trace {str(p)!r} is not a directory; a trace is a directory of Parquet files. {hint}")
    meta_path = p / "meta.json"
    if not meta_path.exists():
        raise TraceError(f"Trace {str(p)!r} has no meta.json, so it is not a complete trace. {hint}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"Trace {str(p)!r}: meta.json is not valid JSON ({e}). {hint}") from e
    if not isinstance(meta, dict):
        raise TraceError(f"Trace {str(p)!r}: meta.json is not a JSON object. {hint}")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise TraceError(
            f"Trace {str(p)!r} has format version {version!r}; this taichi-plan reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Re-record the trace with this version, or use the taichi-plan "
            "version that wrote it."
        )
    _check_meta(meta, p, hint)
    tables, file_metadata = {}, {}
    for name, schema in TABLES.items():
        f = p / f"{name}.parquet"
        if not f.exists():
            raise TraceError(f"Trace {str(p)!r} is missing {name}.parquet. {hint}")
        try:
            table = pq.read_table(f)
        except (pa.ArrowException, OSError) as e:
            raise TraceError(
                f"Trace {str(p)!r}: {name}.parquet cannot be read, it is truncated or not Parquet "
                f"({e}). {hint}"
            ) from e
        for fld in schema:
            if fld.name not in table.schema.names:
                raise TraceError(f"Trace {str(p)!r}: {name}.parquet has no column {fld.name!r}. {hint}")
            got = table.schema.field(fld.name).type
            if not _type_ok(got, fld.type):
                raise TraceError(
                    f"Trace {str(p)!r}: column {name}.{fld.name} has type {got}, expected {fld.type}. "
                    f"The file was not written by taichi-plan's trace format v{FORMAT_VERSION}. {hint}"
                )
        file_metadata[name] = table.schema.metadata
        try:
            table = table.select(schema.names).cast(schema)
        except (pa.ArrowException, ValueError) as e:
            raise TraceError(f"Trace {str(p)!r}: {name}.parquet has values out of range ({e}). {hint}") from e
        tables[name] = _to_pandas(table)
    trace = Trace(tables["ops"], tables["tensors"], tables["accesses"], meta, p)
    validate(trace)
    _check_content_hash(trace, hint, file_metadata)
    return trace


# The JSON type of each meta.json field the package reads (None is allowed for every one:
# absent or not known); meta.json is not covered by the content hash, so an edited field is
# named here rather than failing deep inside a report or the planner.
_META_TYPES = {
    "workload": dict, "loop": dict, "data_sized": dict, "forward_in_backward": dict, "python_refs": dict,
    "module_args": dict, "runtime_overhead": dict, "fsdp": dict, "ddp": dict, "optimizer_view": dict,
    "first_mismatch": dict, "gpu_kernels": dict, "model_calls": list, "called_modules": list, "random_ops": list,
    "backward_nodes": list, "signatures": list, "filtered_ops": list, "name": str, "mode": str, "cost_unit": str,
    "device": str, "dtype": str, "device_profile": str, "signature": str, "step_definition": str,
    "warmup_steps": int, "steps_recorded": int, "kept_step": int, "num_ops": int, "num_tensors": int,
    "steps_match": bool,
}
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "true or false"}


def _check_meta(meta: dict, p: Path, hint: str) -> None:
    """Each field of ``meta`` has its JSON type (:data:`_META_TYPES`), and so do the parts of
    ``loop`` and ``model_calls`` the runtime reads."""
    def bad(name: str, value, want) -> TraceError:
        return TraceError(f"Trace {str(p)!r}: meta.json field {name} is {json.dumps(value)[:60]}, expected "
                          f"{_JSON_NAMES.get(want, want)}. The file was edited or not written by taichi-plan. {hint}")

    def ok(value, want) -> bool:
        if want is int:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, want)

    for name, want in _META_TYPES.items():
        v = meta.get(name)
        if v is not None and not ok(v, want):
            raise bad(name, v, want)
    for key, want in (("micro_batches", int), ("forwards", int), ("set_to_none", bool), ("autocast", str)):
        v = (meta.get("loop") or {}).get(key)
        if v is not None and not ok(v, want):
            raise bad(f"loop.{key}", v, want)
    for k, call in enumerate(meta.get("model_calls") or ()):
        if not isinstance(call, dict):
            raise bad(f"model_calls[{k}]", call, dict)
        for key, want in (("start", int), ("end", int), ("inputs", list), ("grad", bool), ("training", bool),
                          ("trainable", list)):
            v = call.get(key)
            if v is not None and not ok(v, want):
                raise bad(f"model_calls[{k}].{key}", v, want)


def _check_content_hash(trace: Trace, hint: str, file_metadata: dict | None = None) -> None:
    """The tables must still be the ones ``meta.json``'s ``content_hash`` was computed over:
    an edited table would otherwise pass for the trace plans were solved against. A trace
    written when the hash still covered pyarrow's pandas metadata is checked with the metadata
    its files hold (``file_metadata``, per table): what its writer hashed."""
    want = trace.meta.get("content_hash")
    where = f"Trace {str(trace.path)!r}"
    if want is None:
        raise TraceError(f"{where}: meta.json has no content_hash, so the tables cannot be checked. {hint}")
    got = trace.content_hash()
    if got == want or (file_metadata and trace.content_hash(file_metadata) == want):
        return
    # meta.json keeps one hash over all three tables: name the ones written after it.
    meta_time = (trace.path / "meta.json").stat().st_mtime
    newer = [f"{name}.parquet" for name in TABLES if (trace.path / f"{name}.parquet").stat().st_mtime > meta_time]
    which = (f"{', '.join(newer)} {'was' if len(newer) == 1 else 'were'} changed after meta.json was written"
             if newer else "one of ops.parquet, tensors.parquet, accesses.parquet was changed")
    raise TraceError(
        f"{where}: the tables do not match meta.json's content_hash ({got[:12]} instead of {str(want)[:12]}): "
        f"{which}. A trace edited by hand is no longer the step that was recorded, and plans solved for it "
        f"would not apply. {hint}"
    )


def _type_ok(got: pa.DataType, want: pa.DataType) -> bool:
    if got.equals(want):
        return True
    if pa.types.is_integer(want):
        return pa.types.is_integer(got)
    if pa.types.is_floating(want):
        return pa.types.is_floating(got) or pa.types.is_integer(got)
    if pa.types.is_string(want):
        return pa.types.is_string(got) or pa.types.is_large_string(got) or pa.types.is_dictionary(got)
    if pa.types.is_list(want):
        return (pa.types.is_list(got) or pa.types.is_large_list(got)) and pa.types.is_integer(got.value_type)
    return False


def validate(trace: Trace) -> None:
    """Check referential integrity and categorical values; raise :class:`TraceError`."""
    where = f"Trace {str(trace.path)!r}" if trace.path else "Trace"
    ops, tensors, acc = trace.ops, trace.tensors, trace.accesses
    n = len(ops)
    for (table, col), allowed in _CATEGORIES.items():
        values = set(getattr(trace, table)[col].unique())
        bad = values - set(allowed)
        if bad:
            raise TraceError(f"{where}: {table}.{col} has unknown values {sorted(map(str, bad))}; allowed: {list(allowed)}.")
    if n and not np.array_equal(ops["op_id"].to_numpy(), np.arange(n)):
        raise TraceError(f"{where}: ops.op_id must be 0..{n - 1} in execution order.")
    if tensors["tensor_id"].duplicated().any():
        dup = int(tensors.loc[tensors["tensor_id"].duplicated(), "tensor_id"].iloc[0])
        raise TraceError(f"{where}: tensor_id {dup} appears twice in tensors.parquet.")
    if (tensors["nbytes"] < 0).any():
        raise TraceError(f"{where}: tensors.nbytes has negative values.")
    for col in ("producer_op", "alloc_op", "free_op"):
        v = tensors[col].to_numpy()
        bad = (v < -1) | (v >= n)
        if bad.any():
            tid = int(tensors["tensor_id"].to_numpy()[bad][0])
            raise TraceError(
                f"{where}: tensor {tid} has {col}={int(v[bad][0])}, but the trace has ops 0..{n - 1} "
                "(-1 means outside the step). The trace is inconsistent; record it again."
            )
    a, f = tensors["alloc_op"].to_numpy(), tensors["free_op"].to_numpy()
    bad = (a >= 0) & (f >= 0) & (f < a)
    if bad.any():
        tid = int(tensors["tensor_id"].to_numpy()[bad][0])
        raise TraceError(f"{where}: tensor {tid} is freed before it is allocated.")
    ao = acc["op_id"].to_numpy()
    bad = (ao < 0) | (ao >= n)
    if bad.any():
        raise TraceError(
            f"{where}: accesses refer to op {int(ao[bad][0])}, which does not exist (ops 0..{n - 1}). "
            "The trace is inconsistent; record it again."
        )
    known = set(tensors["tensor_id"].tolist())
    missing = set(acc["tensor_id"].unique().tolist()) - known
    if missing:
        raise TraceError(
            f"{where}: accesses refer to tensor {min(missing)}, which is not in tensors.parquet. "
            "The trace is inconsistent; record it again."
        )


# ---------------------------------------------------------------------------------------------
# Baseline memory
# ---------------------------------------------------------------------------------------------


def live_intervals(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor, the first and last op (inclusive) during which it holds memory."""
    n = len(trace.ops)
    start = trace.tensors["alloc_op"].to_numpy().astype(np.int64)
    end = trace.tensors["free_op"].to_numpy().astype(np.int64)
    start = np.where(start < 0, 0, start)
    end = np.where(end < 0, max(n - 1, 0), end)
    return start, end


def baseline_live_bytes(trace: Trace, by_kind: bool = False):
    """Live bytes during each op of the unplanned step (a tensor counts from ``alloc_op``
    through ``free_op`` inclusive; -1 means before/after the step). With ``by_kind`` returns
    ``{kind: array}``.
    """
    n = len(trace.ops)
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return {k: z.copy() for k in KINDS} if by_kind else z
    start, end = live_intervals(trace)
    nbytes = trace.tensors["nbytes"].to_numpy().astype(np.int64)

    def sweep(mask: np.ndarray) -> np.ndarray:
        delta = np.zeros(n + 1, dtype=np.int64)
        np.add.at(delta, start[mask], nbytes[mask])
        np.add.at(delta, end[mask] + 1, -nbytes[mask])
        return np.cumsum(delta)[:n]

    if not by_kind:
        return sweep(np.ones(len(nbytes), dtype=bool))
    kinds = trace.tensors["kind"].to_numpy()
    return {k: sweep(kinds == k) for k in KINDS}


def baseline_peak(trace: Trace) -> tuple[int, int]:
    """(peak bytes, op_id where it first happens) of the unplanned step."""
    live = baseline_live_bytes(trace)
    if len(live) == 0:
        return 0, -1
    i = int(np.argmax(live))
    return int(live[i]), i


# The built-in decoders (``meta.workload.name``) whose forward appends keys and values to a cache;
# ``record --no-kv-cache`` builds them without it.
KV_CACHE_MODELS = ("gpt2", "llama")
