"""inspect's text is as wide as the terminal: COLUMNS when set, 80 off a terminal."""

from __future__ import annotations

from click.testing import CliRunner
from conftest import small_trace
from synthetic import chain_trace

from taichi_plan.cli import main
from taichi_plan.plan.format import save_plan
from taichi_plan.solve import solve
from taichi_plan.trace.format import read_trace, write_trace

LONG_ARGS = {f"argument_{i}": 1000 + i for i in range(8)}  # the workload line: ~150 columns


def _trace_dir(tmp_path):
    trace = small_trace()
    trace.meta["workload"] = {"name": "mlp", "args": LONG_ARGS}
    return write_trace(trace, tmp_path / "wide")


def _inspect(path, columns: str | None):
    res = CliRunner().invoke(main, ["inspect", str(path)], env={"COLUMNS": columns})
    assert res.exit_code == 0, res.output
    return res.output


def test_trace_text_uses_columns(tmp_path):
    tdir = _trace_dir(tmp_path)
    wide = _inspect(tdir, "200")
    whole = ", ".join(f"{k}={v}" for k, v in LONG_ARGS.items())
    assert whole in wide and "…" not in wide
    assert max(map(len, wide.splitlines())) > 80
    mid = _inspect(tdir, "100")
    assert max(map(len, mid.splitlines())) == 100 and "…" in mid


def test_trace_text_is_80_columns_without_columns(tmp_path):
    text = _inspect(_trace_dir(tmp_path), None)  # CliRunner's stdout is not a terminal
    assert max(map(len, text.splitlines())) == 80 and "…" in text


def test_plan_text_uses_columns(tmp_path):
    tdir = write_trace(chain_trace([1000, 1200, 800, 1000, 1500, 900, 1000, 1100], temp_bytes=200),
                       tmp_path / "chain")
    plan = solve(read_trace(tdir), 8000, "heuristic", time_limit=2)
    ppath = save_plan(plan, tmp_path / "chain.plan.json")
    narrow, wide = _inspect(ppath, None), _inspect(ppath, "160")
    assert all(len(line) <= 80 or len(line.split()) <= 2 for line in narrow.splitlines())
    assert max(map(len, wide.splitlines())) > 80
    assert all(len(line) <= 160 for line in wide.splitlines())
    # the planned peak's line (92 columns) is wrapped at 80, whole at 160
    planned = next(line for line in wide.splitlines() if line.startswith("  planned"))
    assert len(planned) > 80 and planned.endswith("backward)")
    assert planned not in narrow.splitlines() and wide.split() == narrow.split()
