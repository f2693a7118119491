"""Trace format v1: lossless round trips (property-based) and clear errors on bad input."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import small_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taichi_plan.base.errors import OutputExistsError, TraceError
from taichi_plan.cli import main
from taichi_plan.trace.format import (
    COST_SOURCES,
    KINDS,
    PHASES,
    ROLES,
    TABLES,
    Trace,
    baseline_peak,
    frame,
    read_trace,
    write_trace,
)

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
TEXT = st.text(max_size=12)  # any unicode but surrogates, "\x00" included
UNICODE_MODULE = st.sampled_from(["", "model.layers.0.attn", "módulo.ß", "模型.层", "😀.x"]) | TEXT


def _frame(table: str, rows: dict[str, list]):
    """``frame`` for generated rows (empty tables included)."""
    return frame(table, rows)


def test_frame_accepts_empty_lists():
    df = frame("tensors", {f.name: [] for f in TABLES["tensors"]})
    assert len(df) == 0


def test_baseline_peak_without_ops():
    t = small_trace()
    empty = Trace(t.ops.iloc[0:0].reset_index(drop=True), t.tensors.iloc[:1].copy(),
                  t.accesses.iloc[0:0].reset_index(drop=True), {})
    assert baseline_peak(empty) == (0, -1)


@st.composite
def traces(draw) -> Trace:
    n = draw(st.integers(0, 8))
    ops = _frame(
        "ops",
        {
            "op_id": list(range(n)),
            "step": draw(st.lists(INT32, min_size=n, max_size=n)),
            "phase": draw(st.lists(st.sampled_from(PHASES), min_size=n, max_size=n)),
            "op": draw(st.lists(TEXT, min_size=n, max_size=n)),
            "module": draw(st.lists(UNICODE_MODULE, min_size=n, max_size=n)),
            "duration_s": draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=n, max_size=n)),
            "flops": draw(st.lists(st.integers(0, 2**63 - 1), min_size=n, max_size=n)),
            "cost_source": draw(st.lists(st.sampled_from(COST_SOURCES), min_size=n, max_size=n)),
            "recomputable": draw(st.lists(st.booleans(), min_size=n, max_size=n)),
            "mutates": draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        },
    )
    ids = draw(st.lists(INT64, max_size=10, unique=True))
    m = len(ids)
    op_ref = st.integers(-1, n - 1)
    rows = {k: [] for k in ("producer_op", "alloc_op", "free_op")}
    for _ in range(m):
        alloc = draw(op_ref)
        free = draw(st.just(-1) | st.integers(max(alloc, 0), n - 1)) if n else -1
        rows["producer_op"].append(draw(op_ref))
        rows["alloc_op"].append(alloc)
        rows["free_op"].append(free)
    tensors = _frame(
        "tensors",
        {
            "tensor_id": ids,
            "nbytes": draw(st.lists(st.integers(0, 2**40), min_size=m, max_size=m)),
            "dtype": draw(st.lists(st.sampled_from(["float32", "bfloat16", "int64", "bool"]) | TEXT,
                                   min_size=m, max_size=m)),
            "shape": draw(st.lists(st.lists(st.integers(0, 2**40), max_size=4), min_size=m, max_size=m)),
            "kind": draw(st.lists(st.sampled_from(KINDS), min_size=m, max_size=m)),
            **rows,
        },
    )
    k = draw(st.integers(0, 12)) if n and m else 0
    accesses = _frame(
        "accesses",
        {
            "op_id": draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k)) if k else [],
            "tensor_id": draw(st.lists(st.sampled_from(ids), min_size=k, max_size=k)) if k else [],
            "role": draw(st.lists(st.sampled_from(ROLES), min_size=k, max_size=k)),
            "arg_index": draw(st.lists(st.integers(0, 2**31 - 1), min_size=k, max_size=k)),
        },
    )
    meta = {"name": draw(TEXT), "workload": {"name": draw(UNICODE_MODULE), "args": {"b": draw(INT32)}}}
    return Trace(ops, tensors, accesses, meta)


def _assert_same_tables(a: Trace, b: Trace) -> None:
    for name in ("ops", "tensors", "accesses"):
        x, y = getattr(a, name), getattr(b, name)
        assert list(x.columns) == list(y.columns)
        assert x.dtypes.equals(y.dtypes), (name, x.dtypes, y.dtypes)
        pd.testing.assert_frame_equal(x, y, check_dtype=True)
    assert [list(s) for s in a.tensors["shape"]] == [list(s) for s in b.tensors["shape"]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_round_trip_loses_nothing(trace: Trace):
    before = trace.content_hash()
    original = Trace(trace.ops.copy(), trace.tensors.copy(), trace.accesses.copy(), dict(trace.meta))
    with tempfile.TemporaryDirectory() as d:
        out = write_trace(trace, Path(d) / "t")
        back = read_trace(out)
        _assert_same_tables(original, back)
        assert back.content_hash() == before == back.meta["content_hash"] == trace.content_hash()
        assert back.meta["name"] == original.meta["name"]
        assert back.meta["workload"] == original.meta["workload"]
        if len(original.ops):  # see test_baseline_peak_without_ops
            assert baseline_peak(back) == baseline_peak(original)
        # writing again (forced) keeps the hash: it is over contents, not file bytes
        write_trace(back, out, force=True)
        assert read_trace(out).content_hash() == before


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def written(tmp_path) -> Path:
    return write_trace(small_trace(), tmp_path / "small")


def _flat(text: str) -> str:
    return " ".join(text.split())


def _expect(path: Path, *fragments: str) -> None:
    """read_trace raises TraceError saying each fragment; inspect exits 3 saying the same."""
    with pytest.raises(TraceError) as e:
        read_trace(path)
    for f in fragments:
        assert f in str(e.value), str(e.value)
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == TraceError.exit_code == 3, r.output
    out = _flat(r.output)
    assert out.startswith("Error:")
    for f in fragments:
        assert _flat(f) in out, out


def test_small_trace_reads(written):
    t = read_trace(written)
    _assert_same_tables(small_trace(), t)


def test_missing_directory(tmp_path):
    _expect(tmp_path / "nope", "does not exist", "taichi-plan record")


@pytest.mark.parametrize("table", ["ops", "tensors", "accesses"])
def test_missing_parquet(written, table):
    (written / f"{table}.parquet").unlink()
    _expect(written, f"missing {table}.parquet")


def test_truncated_parquet(written):
    f = written / "tensors.parquet"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _expect(written, "tensors.parquet cannot be read", "truncated")


def test_wrong_column_type(written):
    t = pq.read_table(written / "ops.parquet")
    i = t.schema.get_field_index("op_id")
    t = t.set_column(i, "op_id", pa.array([str(v) for v in t.column("op_id").to_pylist()]))
    pq.write_table(t, written / "ops.parquet")
    _expect(written, "column ops.op_id has type string, expected int32")


def test_missing_column(written):
    t = pq.read_table(written / "tensors.parquet").drop_columns(["kind"])
    pq.write_table(t, written / "tensors.parquet")
    _expect(written, "tensors.parquet has no column 'kind'")


def test_unknown_format_version(written):
    meta = json.loads((written / "meta.json").read_text())
    meta["format_version"] = 99
    (written / "meta.json").write_text(json.dumps(meta))
    _expect(written, "format version 99", "reads versions 1, 2")


@pytest.mark.parametrize("content", ["{not json", "", "\xff\xfe"])
def test_meta_not_json(written, content):
    (written / "meta.json").write_text(content, encoding="latin-1")
    _expect(written, "meta.json is not valid JSON")


def test_meta_not_object(written):
    (written / "meta.json").write_text("[1, 2]")
    _expect(written, "meta.json is not a JSON object")


def test_meta_missing(written):
    (written / "meta.json").unlink()
    _expect(written, "has no meta.json")


def _rewrite_accesses(path: Path, op_id: int, tensor_id: int) -> None:
    t = pq.read_table(path / "accesses.parquet")
    extra = pa.table(
        {"op_id": pa.array([op_id], pa.int32()), "tensor_id": pa.array([tensor_id], pa.int64()),
         "role": ["read"], "arg_index": pa.array([0], pa.int32())}
    )
    pq.write_table(pa.concat_tables([t, extra]), path / "accesses.parquet")


def test_access_to_missing_op(written):
    _rewrite_accesses(written, 6, 10)
    _expect(written, "accesses refer to op 6, which does not exist")


def test_access_to_missing_tensor(written):
    _rewrite_accesses(written, 0, 999)
    _expect(written, "accesses refer to tensor 999, which is not in tensors.parquet")


def test_tensor_freed_before_alloc(written):
    t = pq.read_table(written / "tensors.parquet")
    free = t.column("free_op").to_pylist()
    free[3] = 0  # tensor 13 is allocated at op 0... make it free before: alloc 1
    alloc = t.column("alloc_op").to_pylist()
    alloc[3] = 2
    t = t.set_column(t.schema.get_field_index("free_op"), "free_op", pa.array(free, pa.int32()))
    t = t.set_column(t.schema.get_field_index("alloc_op"), "alloc_op", pa.array(alloc, pa.int32()))
    pq.write_table(t, written / "tensors.parquet")
    _expect(written, "tensor 13 is freed before it is allocated")


def test_unknown_phase(written):
    t = pq.read_table(written / "ops.parquet")
    phases = t.column("phase").to_pylist()
    phases[0] = "sideways"
    t = t.set_column(t.schema.get_field_index("phase"), "phase", pa.array(phases))
    pq.write_table(t, written / "ops.parquet")
    _expect(written, "ops.phase has unknown values ['sideways']")


def test_not_a_directory(tmp_path):
    f = tmp_path / "file.parquet"
    f.write_text("x")
    _expect(f, "is not a directory")


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_write_refuses_existing_without_force(tmp_path):
    out = write_trace(small_trace(), tmp_path / "t")
    before = (out / "meta.json").read_text()
    with pytest.raises(OutputExistsError, match="force=True") as e:
        write_trace(small_trace(), out)
    assert "--force" not in str(e.value)  # library callers are told about the keyword, not the flag
    assert (out / "meta.json").read_text() == before
    assert _leftovers(tmp_path) == []
    t = small_trace()
    t.meta["name"] = "renamed"
    write_trace(t, out, force=True)
    assert read_trace(out).meta["name"] == "renamed"
    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in out.iterdir()) == [
        "accesses.parquet", "meta.json", "ops.parquet", "tensors.parquet"]


def test_write_refuses_invalid_trace_and_leaves_nothing(tmp_path):
    t = small_trace()
    t.tensors.loc[0, "kind"] = "mystery"
    with pytest.raises(TraceError, match="mystery"):
        write_trace(t, tmp_path / "bad")
    assert list(tmp_path.iterdir()) == []


def test_write_failure_midway_leaves_no_temp_dir(tmp_path, monkeypatch):
    import taichi_plan.trace.format as trace_mod
    from taichi_plan.base.errors import OutputError

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace_mod.pq, "write_table", boom)
    with pytest.raises(OutputError, match="No space left on device"):
        write_trace(small_trace(), tmp_path / "t")
    assert list(tmp_path.iterdir()) == []


def test_write_creates_missing_parents(tmp_path):
    out = write_trace(small_trace(), tmp_path / "no" / "such" / "t")
    assert read_trace(out).num_ops == small_trace().num_ops
