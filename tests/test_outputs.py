"""Outputs: what --force may replace, stale temp siblings, unwritable locations, missing
directories, default names, shared flags and messages.

Tests run as root here, where a read-only mode does not stop a write: an unwritable location
is a path under a regular file, or an OSError injected with monkeypatch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import small_trace

import taichi_plan.base.atomic as atomic
from taichi_plan.base.errors import OutputError, OutputExistsError
from taichi_plan.cli import main
from taichi_plan.commands import COMMANDS
from taichi_plan.commands._common import UNITS, handle_errors
from taichi_plan.plan.format import save_plan
from taichi_plan.solve import solve
from taichi_plan.trace.format import read_trace, write_trace

REPO = Path(__file__).resolve().parents[1]
GRAPH = {  # a three-node Moccasin graph: enough for import-graph
    "directed": True, "multigraph": False, "graph": {"order": [0, 1, 2]},
    "nodes": [{"name": 0, "duration": 1, "out_cost": 10}, {"name": 1, "duration": 2, "out_cost": 20},
              {"name": 2, "duration": 1, "out_cost": 5}],
    "links": [{"0": 0, "1": 1}, {"0": 1, "1": 2}],
}


def _flat(text: str) -> str:
    """CLI errors are wrapped at 88 columns; compare with whitespace collapsed."""
    return " ".join(text.split())


def _clean_error(r, code: int) -> str:
    """The command failed with ``code`` and a message, not a traceback; returns the message."""
    assert r.exit_code == code, r.output
    assert isinstance(r.exception, SystemExit), r.exception  # an escaped exception is a traceback
    assert "Traceback" not in r.output and r.stderr.startswith("Error: ")
    return _flat(r.stderr)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def graph_file(tmp_path) -> Path:
    p = tmp_path / "tiny_graph.json"
    p.write_text(json.dumps(GRAPH))
    return p


@pytest.fixture
def plan_file(tmp_path) -> Path:
    """A plan for the small trace, with its trace beside it (so inspect can draw it)."""
    tdir = write_trace(small_trace(), tmp_path / "traces" / "small")
    plan = solve(read_trace(tdir), 2500, "none")
    return save_plan(plan, tmp_path / "small.plan.json")


def _fail(*args, **kwargs):
    pytest.fail("the work ran although the output could not be written")


# ---------------------------------------------------------------------------------------------
# 1. --force replaces a trace or a plan, never anything else
# ---------------------------------------------------------------------------------------------


def test_import_graph_force_into_the_traces_folder_deletes_nothing(tmp_path, graph_file):
    traces = tmp_path / "traces"
    for i in range(8):
        write_trace(small_trace(), traces / f"model{i}")
    (traces / "NOTES.md").write_text("my notes\n")
    before = _snapshot(traces)
    r = CliRunner().invoke(main, ["import-graph", str(graph_file), "-o", str(traces), "--force"])
    msg = _clean_error(r, OutputError.exit_code)
    assert _snapshot(traces) == before
    assert "9 entries" in msg and "NOTES.md" in msg and "model0/" in msg and "and 5 more" in msg
    assert "-o" in msg and "force=True" not in msg


def test_record_force_keeps_an_unrelated_file(tmp_path, monkeypatch):
    import taichi_plan.record as rec

    out = tmp_path / "somedir"
    out.mkdir()
    (out / "important.txt").write_text("keep me\n")
    monkeypatch.setattr(rec, "record_workload", _fail)  # refused before recording
    r = CliRunner().invoke(main, ["record", "--model", "mlp", "-o", str(out), "--force"])
    msg = _clean_error(r, OutputError.exit_code)
    assert "important.txt" in msg and (out / "important.txt").read_text() == "keep me\n"


def test_write_trace_force_replaces_only_a_trace(tmp_path):
    out = write_trace(small_trace(), tmp_path / "t")
    (out / "extra.csv").write_text("1,2\n")
    with pytest.raises(OutputError, match="extra.csv") as e:
        write_trace(small_trace(), out, force=True)
    assert "force=True" in str(e.value) and "--force" not in str(e.value)
    assert (out / "extra.csv").exists() and (out / "meta.json").exists()
    (out / "extra.csv").unlink()
    write_trace(small_trace(), out, force=True)  # a trace and nothing else: replaced
    file_not_dir = tmp_path / "f"
    file_not_dir.write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        write_trace(small_trace(), file_not_dir, force=True)
    assert file_not_dir.read_text() == "x"


def test_solve_force_replaces_only_a_plan(tmp_path, plan_file):
    trace = str(tmp_path / "traces" / "small")
    run = CliRunner().invoke
    for name, text in [("notes.json", '{"a": 1}\n'), ("notes.txt", "not JSON at all\n")]:
        other = tmp_path / name
        other.write_text(text)
        msg = _clean_error(run(main, ["solve", trace, "-b", "100%", "-m", "none", "-o", str(other), "--force"]),
                           OutputError.exit_code)
        assert "not a plan file" in msg and other.read_text() == text
    folder = tmp_path / "plans"
    (folder / "keep").mkdir(parents=True)
    msg = _clean_error(run(main, ["solve", trace, "-b", "100%", "-m", "none", "-o", str(folder), "--force"]),
                       OutputError.exit_code)
    assert "is a directory" in msg and (folder / "keep").is_dir()
    r = run(main, ["solve", trace, "-b", "100%", "-m", "none", "-o", str(plan_file), "--force"])
    assert r.exit_code == 0, r.output  # our own plan is still replaced


def test_report_outputs_never_replace_a_directory(tmp_path, plan_file):
    folder = tmp_path / "out"
    (folder / "keep.txt").parent.mkdir()
    (folder / "keep.txt").write_text("k")
    run = CliRunner().invoke
    for flag in ("--png", "--html"):
        msg = _clean_error(run(main, ["inspect", str(plan_file), flag, str(folder), "--force"]),
                           OutputError.exit_code)
        assert "is a directory" in msg and flag in msg
    msg = _clean_error(run(main, ["compare", str(tmp_path / "traces" / "small"), "-b", "100%", "-m", "none",
                                  "--png", str(folder), "--force"]), OutputError.exit_code)
    assert "is a directory" in msg
    assert (folder / "keep.txt").read_text() == "k"


def test_png_and_html_force_replace_only_a_png_or_a_page(tmp_path, plan_file):
    plan_before = plan_file.read_bytes()
    run = CliRunner().invoke
    for flag in ("--png", "--html"):  # the plan itself typed as the output, by mistake
        msg = _clean_error(run(main, ["inspect", str(plan_file), flag, str(plan_file), "--force"]),
                           OutputError.exit_code)
        assert "is not a" in msg and flag in msg
    msg = _clean_error(run(main, ["compare", str(tmp_path / "traces" / "small"), "-b", "100%", "-m", "none",
                                  "--png", str(plan_file), "--force"]), OutputError.exit_code)
    assert "is not a PNG file" in msg and plan_file.read_bytes() == plan_before
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    for args in (["--png", str(png)], ["--html", str(page)]):
        assert run(main, ["inspect", str(plan_file), *args]).exit_code == 0
        r = run(main, ["inspect", str(plan_file), *args, "--force"])  # our own report: replaced
        assert r.exit_code == 0, r.output


def test_replay_report_replaces_only_a_replay_report(tmp_path, plan_file, monkeypatch):
    import taichi_plan.replay.measure as measure

    monkeypatch.setattr(measure, "replay", _fail)
    other = tmp_path / "mine.json"
    other.write_text('{"mine": true}\n')
    r = CliRunner().invoke(main, ["replay", str(plan_file), "-o", str(other)])
    msg = _clean_error(r, OutputError.exit_code)
    assert "not a replay report" in msg and other.read_text() == '{"mine": true}\n'


# ---------------------------------------------------------------------------------------------
# 2. A killed write: stale temp siblings are swept, the target is never lost
# ---------------------------------------------------------------------------------------------

_KILLED_WRITER = """
import sys, time
from pathlib import Path
from taichi_plan.base.atomic import replace_dir_atomic

def build(tmp):
    (tmp / "ops.parquet").write_bytes(b"PAR1 half a table")
    Path(sys.argv[2]).write_text(str(tmp))
    time.sleep(120)

replace_dir_atomic(build, sys.argv[1])
"""


def test_sigkilled_write_leaves_old_trace_and_next_write_sweeps(tmp_path):
    target = write_trace(small_trace(), tmp_path / "existing")
    ready = tmp_path / "ready"
    unrelated = [tmp_path / ".existing.notes", tmp_path / ".other.abcd1234.tmp"]
    for p in unrelated:
        p.write_text("not ours to remove")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(target), str(ready)], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the writer never reached its build step"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    leftover = Path(ready.read_text())
    assert re.fullmatch(r"\.existing\.[a-z0-9_]{8}\.tmp", leftover.name)
    assert (leftover / "ops.parquet").exists()
    assert read_trace(target).num_ops == small_trace().num_ops  # the old trace is untouched

    t = small_trace()
    t.meta["name"] = "second"
    write_trace(t, target, force=True)
    assert not leftover.exists()
    assert read_trace(target).meta["name"] == "second"
    assert all(p.read_text() == "not ours to remove" for p in unrelated)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(
        p.name for p in unrelated)


def test_stale_file_temps_are_swept_by_the_next_write(tmp_path, plan_file):
    png_leftover = tmp_path / ".t.png.abcd_123.tmp.png"
    plan_leftover = tmp_path / ".small.plan.json.zz99zz99.tmp"
    for p in (png_leftover, plan_leftover):
        p.write_bytes(b"partial")
    plan = solve(read_trace(tmp_path / "traces" / "small"), 2500, "none")
    save_plan(plan, plan_file, force=True)
    assert not plan_leftover.exists() and png_leftover.exists()  # only the target's own
    r = CliRunner().invoke(main, ["inspect", str(plan_file), "--png", str(tmp_path / "t.png")])
    assert r.exit_code == 0, r.output
    assert not png_leftover.exists()


def test_failed_second_rename_puts_the_old_trace_back(tmp_path, monkeypatch):
    target = write_trace(small_trace(), tmp_path / "t")
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the two-rename path
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if Path(dst) == target and Path(src).name.endswith(".tmp"):  # the new one moving in
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        write_trace(small_trace(), target, force=True)
    assert ("t", calls[0][1]) == calls[0] and calls[0][1].endswith(".old")  # old moved aside first
    assert read_trace(target).num_ops == small_trace().num_ops
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_killed_between_renames_the_old_trace_comes_back(tmp_path):
    """The state a SIGKILL between the two renames leaves: target missing, ``.old`` complete."""
    old = write_trace(small_trace(), tmp_path / "t")
    os.replace(old, tmp_path / ".t.k1ll3d00.old")
    (tmp_path / ".t.k1ll3d01.tmp").mkdir()
    bad = small_trace()
    bad.tensors.loc[0, "kind"] = "mystery"
    with pytest.raises(Exception, match="mystery"):  # even a write that fails validation
        write_trace(bad, tmp_path / "t", force=True)
    assert read_trace(tmp_path / "t").num_ops == small_trace().num_ops


def test_replace_swaps_in_one_step_where_the_os_can(tmp_path, monkeypatch):
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux-only")
    target = write_trace(small_trace(), tmp_path / "t")
    seen = []
    real = atomic._exchange
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: seen.append(real(a, b)) or seen[-1])
    t = small_trace()
    t.meta["name"] = "swapped"
    write_trace(t, target, force=True)
    if seen != [True]:
        pytest.skip("this file system has no RENAME_EXCHANGE")
    assert read_trace(target).meta["name"] == "swapped"
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


# ---------------------------------------------------------------------------------------------
# 3. Unwritable locations: refused before the work; a failed write is a message
# ---------------------------------------------------------------------------------------------


def test_every_command_checks_its_output_before_the_work(tmp_path, plan_file, graph_file, monkeypatch):
    import taichi_plan.commands.compare as compare_cmd
    import taichi_plan.commands.solve as solve_cmd
    import taichi_plan.record as rec
    import taichi_plan.replay.measure as measure
    import taichi_plan.trace.import_graph as ig

    for mod, name in [(rec, "record_workload"), (solve_cmd, "solve"), (compare_cmd, "compare"),
                      (measure, "replay")]:
        monkeypatch.setattr(mod, name, _fail)
    monkeypatch.setattr("taichi_plan.commands.import_graph.import_graph", _fail)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    under = blocker / "sub"
    trace = str(tmp_path / "traces" / "small")
    cases = [
        (["record", "--model", "mlp", "-o", str(under / "t")], "-o"),
        (["import-graph", str(graph_file), "-o", str(under / "t")], "-o"),
        (["solve", trace, "-b", "100%", "-o", str(under / "p.plan.json")], "-o"),
        (["compare", trace, "-b", "100%", "--png", str(under / "c.png")], "--png"),
        (["inspect", str(plan_file), "--png", str(under / "i.png")], "--png"),
        (["inspect", str(plan_file), "--html", str(under / "i.html")], "--html"),
        (["replay", str(plan_file), "-o", str(under / "r.json")], "-o"),
    ]
    assert ig  # the library import_graph stays; the command's reference is what is patched
    for args, flag in cases:
        msg = _clean_error(CliRunner().invoke(main, args), OutputError.exit_code)
        assert "is not a directory" in msg and f"another path with {flag}" in msg, args
    assert blocker.read_text() == ""


def test_unwritable_directory_is_found_by_the_probe(tmp_path, monkeypatch):
    import taichi_plan.commands.solve as solve_cmd

    write_trace(small_trace(), tmp_path / "t")
    monkeypatch.setattr(solve_cmd, "solve", _fail)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic.tempfile, "mkstemp", denied)
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "t"), "-b", "100%", "-o", str(tmp_path / "p.plan.json")])
    msg = _clean_error(r, OutputError.exit_code)
    assert "not writable (Permission denied)" in msg


def test_a_write_that_fails_is_an_output_error(tmp_path, plan_file, monkeypatch):
    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", full)
    trace = str(tmp_path / "traces" / "small")
    run = CliRunner().invoke
    for args in (["solve", trace, "-b", "100%", "-m", "none", "-o", str(tmp_path / "new.plan.json")],
                 ["inspect", str(plan_file), "--png", str(tmp_path / "new.png")],
                 ["inspect", str(plan_file), "--html", str(tmp_path / "new.html")]):
        msg = _clean_error(run(main, args), OutputError.exit_code)
        assert "No space left on device" in msg, args
    with pytest.raises(OutputError, match="No space left"):
        write_trace(small_trace(), tmp_path / "traces" / "other")
    assert not (tmp_path / "new.plan.json").exists()
    assert not [p for p in tmp_path.rglob(".*") if p.name.endswith((".tmp", ".tmp.png", ".old"))]


def test_an_escaped_oserror_is_a_message_not_a_traceback():
    import click

    @click.command()
    @handle_errors
    def cmd():
        raise PermissionError(13, "Permission denied", "/somewhere/x")

    r = CliRunner().invoke(cmd, [])
    msg = _clean_error(r, OutputError.exit_code)
    assert "Permission denied" in msg and "/somewhere/x" in msg


# ---------------------------------------------------------------------------------------------
# 4. Missing parent directories are created, by every command
# ---------------------------------------------------------------------------------------------


def test_missing_directories_are_created(tmp_path, plan_file, graph_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = CliRunner().invoke
    r = run(main, ["import-graph", str(graph_file), "-o", "fresh/traces/g"])
    assert r.exit_code == 0, r.output
    assert read_trace(tmp_path / "fresh" / "traces" / "g").num_ops == 3
    r = run(main, ["record", "--model", "mlp", "--hidden", "32", "--layers", "1", "--batch", "2", "--fake",
                   "-o", "fresh2/traces/mlp"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "fresh2" / "traces" / "mlp" / "meta.json").is_file()
    r = run(main, ["solve", "fresh/traces/g", "-b", "100%", "-m", "none", "-o", "a/b/g.plan.json"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "a" / "b" / "g.plan.json").is_file()
    r = run(main, ["inspect", str(plan_file), "--png", "c/d/t.png"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "c" / "d" / "t.png").is_file()


# ---------------------------------------------------------------------------------------------
# 5. The default plan is named after the trace directory
# ---------------------------------------------------------------------------------------------


def test_default_plan_name_is_the_trace_directory(tmp_path, monkeypatch):
    t = small_trace()
    t.meta["name"] = "VGG16_256_224x224_train_nx"
    write_trace(t, tmp_path / "traces" / "vgg")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["solve", "traces/vgg/", "-b", "100%", "-m", "none"])
    assert r.exit_code == 0, r.output
    assert [p.name for p in (tmp_path / "plans").iterdir()] == ["vgg.plan.json"]
    assert "Wrote plans/vgg.plan.json" in r.output


# ---------------------------------------------------------------------------------------------
# 6. One --units flag; messages name the flags the command has and the audience's spelling
# ---------------------------------------------------------------------------------------------


def test_units_is_one_choice_everywhere(tmp_path):
    with_units = {c.name: p for c in COMMANDS for p in c.params if p.name == "units"}
    assert set(with_units) == {"solve", "inspect", "compare", "maxbatch"}
    for name, param in with_units.items():
        assert list(param.type.choices) == UNITS, name
    write_trace(small_trace(), tmp_path / "t")
    run = CliRunner().invoke
    r = run(main, ["solve", str(tmp_path / "t"), "-b", "100%", "-m", "none", "--units", "furlongs",
                   "-o", str(tmp_path / "p.plan.json")])
    assert r.exit_code == 2 and "furlongs" in r.output and not (tmp_path / "p.plan.json").exists()
    r = run(main, ["solve", str(tmp_path / "t"), "-b", "100%", "-m", "none", "--units", "kib",
                   "-o", str(tmp_path / "p.plan.json")])
    assert r.exit_code == 2
    r = run(main, ["solve", str(tmp_path / "t"), "-b", "100%", "-m", "none", "--units", "gib",
                   "-o", str(tmp_path / "p.plan.json")])
    assert r.exit_code == 0 and " GiB" in r.output
    r = run(main, ["inspect", str(tmp_path / "t"), "--units", "auto"])
    assert r.exit_code == 0, r.output


_DASH_O = re.compile(r"(?<![\w-])-o(?![\w-])")


def test_exists_messages_name_the_real_flag(tmp_path, plan_file):
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    png.write_bytes(atomic.PNG_MAGIC + b"...")
    page.write_text("<!DOCTYPE html>\n<html></html>\n")
    msg = _clean_error(CliRunner().invoke(main, ["inspect", str(plan_file), "--png", str(png)]),
                       OutputExistsError.exit_code)
    assert "--force" in msg and "another path with --png" in msg and not _DASH_O.search(msg)
    msg = _clean_error(CliRunner().invoke(main, ["inspect", str(plan_file), "--html", str(page)]),
                       OutputExistsError.exit_code)
    assert "another path with --html" in msg and not _DASH_O.search(msg)


def test_library_and_cli_are_each_told_their_own_spelling(tmp_path, plan_file):
    plan = solve(read_trace(tmp_path / "traces" / "small"), 2500, "none")
    with pytest.raises(OutputExistsError) as e:
        save_plan(plan, plan_file)
    assert "force=True" in str(e.value) and "--force" not in str(e.value)
    assert "--force" in e.value.cli_message and "force=True" not in e.value.cli_message
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "traces" / "small"), "-b", "100%", "-o", str(plan_file)])
    msg = _clean_error(r, OutputExistsError.exit_code)
    assert "Pass --force" in msg and "another path with -o" in msg and "force=True" not in msg


# ---------------------------------------------------------------------------------------------
# 7. No import cycle
# ---------------------------------------------------------------------------------------------


def test_commands_import_on_their_own():
    for module in ("taichi_plan.commands", "taichi_plan.commands.solve", "taichi_plan.cli"):
        r = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
