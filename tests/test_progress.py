"""Progress off a terminal: long commands print a plain line to stderr every interval (here
shortened), saying what they are doing; short runs and stdout stay clean."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from synthetic import chain_trace

from taichi_plan.cli import main
from taichi_plan.commands import _common
from taichi_plan.commands._common import Status
from taichi_plan.trace.format import write_trace


@pytest.fixture
def trace_dir(tmp_path):
    sizes = [1000, 1200, 800, 1000, 1500, 900, 1000, 1100] * 3
    return write_trace(chain_trace(sizes, temp_bytes=200), tmp_path / "chain")


@pytest.fixture
def fast_lines(monkeypatch):
    monkeypatch.setattr(_common, "PLAIN_INTERVAL_S", 0.01)


def test_status_prints_plain_lines_when_not_a_terminal(capsys):
    with Status("comparing", 4, interval_s=0.02) as status:
        status.step(2, 4, "dtr at 1.20 GB")
        time.sleep(0.15)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("comparing: dtr at 1.20 GB (2/4), ") for line in lines)
    assert lines[-1].endswith(" s")


def test_status_is_silent_for_a_short_run(capsys):
    with Status("solving", 60, timed=True) as status:  # default interval: 10 s
        status.update("auto (limit 60s)")
    assert capsys.readouterr().err == ""


def test_compare_sweep_progress_on_stderr(trace_dir, fast_lines):
    r = CliRunner().invoke(main, ["compare", str(trace_dir), "--sweep", "0.9,0.7,0.5", "--time-limit", "1",
                                  "--json"])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # stdout holds the JSON alone
    lines = [line for line in r.stderr.splitlines() if line.startswith("comparing: ")]
    assert lines, r.stderr
    assert any("/24)" in line for line in lines)  # 3 budgets x 8 methods


def test_solve_progress_on_stderr(trace_dir, tmp_path, fast_lines):
    r = CliRunner().invoke(main, ["solve", str(trace_dir), "--budget", "60%", "--method", "ilp",
                                  "--time-limit", "1", "-o", str(tmp_path / "p.plan.json")])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("solving: ")]
    assert lines and lines[0].startswith("solving: ilp") and lines[0].endswith("of 1 s)"), r.stderr
    assert "solving" not in r.stdout


def test_maxbatch_progress_on_stderr(fast_lines):
    r = CliRunner().invoke(main, ["maxbatch", "--model", "mlp", "--layers", "1", "--hidden", "32",
                                  "--optimizer", "sgd", "--budget", "2MB", "--limit", "16", "--method",
                                  "heuristic", "--time-limit", "2", "--json"])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)
    lines = [line for line in r.stderr.splitlines() if line.startswith("searching: ")]
    assert any("batch" in line for line in lines), r.stderr
