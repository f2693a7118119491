"""`taichi-plan record` through the click entry point: exit codes, messages, files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from taichi_plan.base.errors import OutputExistsError, UsageError, WorkloadError
from taichi_plan.cli import main
from taichi_plan.trace.format import read_trace

REPO = Path(__file__).resolve().parents[1]
MLP_ARGS = ["record", "--model", "mlp", "--hidden", "64", "--layers", "2", "--batch", "8"]


@pytest.fixture
def runner():
    return CliRunner()


def test_unknown_model_lists_known_ones(runner, tmp_path):
    result = runner.invoke(main, ["record", "--model", "nope", "-o", str(tmp_path / "t")])
    assert result.exit_code == WorkloadError.exit_code != 0
    for name in ("mlp", "gpt2", "bert", "llama", "resnet50", "vit"):
        assert name in result.output
    assert not (tmp_path / "t").exists()


def test_record_writes_trace_and_refuses_existing(runner, tmp_path):
    out = tmp_path / "mlp"
    result = runner.invoke(main, [*MLP_ARGS, "-o", str(out)])
    assert result.exit_code == 0, result.output
    m = re.search(r"^Wrote (.+) \((\d+) ops, peak .+ at op (\d+)\)$", result.output.strip().splitlines()[-1])
    assert m and Path(m.group(1)) == out
    trace = read_trace(out)
    assert len(trace.ops) == int(m.group(2))
    assert trace.meta["workload"]["args"]["hidden"] == 64

    again = runner.invoke(main, [*MLP_ARGS, "-o", str(out)])
    assert again.exit_code == OutputExistsError.exit_code
    assert "--force" in again.output
    forced = runner.invoke(main, [*MLP_ARGS, "-o", str(out), "--force", "--fake", "--device-profile", "h100-80gb"])
    assert forced.exit_code == 0, forced.output
    assert read_trace(out).meta["device_profile"] == "h100-80gb"


def test_existing_output_is_refused_before_recording(runner, tmp_path, monkeypatch):
    out = tmp_path / "exists"
    out.mkdir()
    import taichi_plan.record as rec

    monkeypatch.setattr(rec, "record_workload", lambda *a, **k: pytest.fail("recorded anyway"))
    result = runner.invoke(main, [*MLP_ARGS, "-o", str(out)])
    assert result.exit_code == OutputExistsError.exit_code


def test_bad_flags(runner, tmp_path):
    out = str(tmp_path / "t")
    r = runner.invoke(main, ["record", "-o", out])
    assert r.exit_code == UsageError.exit_code and "--model" in r.output
    r = runner.invoke(main, ["record", "--model", "mlp", "--seq", "5", "-o", out])
    assert r.exit_code == UsageError.exit_code and "--seq" in r.output
    r = runner.invoke(main, ["record", "--model", "mlp", "--fake", "--device-profile", "tpu", "-o", out])
    assert r.exit_code == UsageError.exit_code and "a100-40gb" in r.output


@pytest.mark.parametrize(
    "entry,expected",
    [
        ("no_such_module_xyz:make", "cannot import"),
        ("examples.my_workload", "module.path:function"),
        ("examples.my_workload:nope", "has no attribute"),
        ("examples.my_workload:_DTYPES", "not a function"),
        ("json:dumps", "raised"),
        ("os:getcwd", "returned a str"),
    ],
)
def test_bad_entry_gives_clear_error(runner, tmp_path, monkeypatch, entry, expected):
    monkeypatch.chdir(REPO)
    result = runner.invoke(main, ["record", "--entry", entry, "-o", str(tmp_path / "t")])
    assert result.exit_code == WorkloadError.exit_code, result.output
    assert expected in result.output
    if expected != "raised":
        assert "(model, batch, loss_fn, optimizer)" in result.output.replace("\n", " ")


def test_example_entry_records(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "mine"
    result = runner.invoke(main, ["record", "--entry", "examples.my_workload:make_step", "--batch", "8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    trace = read_trace(out)
    assert trace.meta["workload"]["kind"] == "entry"
    assert trace.meta["workload"]["args"] == {"batch": 8, "dtype": "fp32"}
    assert "blocks.0.1" in set(trace.ops["module"])
    fake = runner.invoke(main, ["record", "--entry", "examples.my_workload:make_step", "--fake", "--cpu-kernels",
                                "-o", str(tmp_path / "f")])
    assert fake.exit_code == 0, fake.output
    assert read_trace(tmp_path / "f").ops["op"].tolist() == read_trace(
        _record_default(runner, tmp_path)
    ).ops["op"].tolist()


def _record_default(runner, tmp_path):
    out = tmp_path / "real-default"
    r = runner.invoke(main, ["record", "--entry", "examples.my_workload:make_step", "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_devices_lists_profiles(runner):
    result = runner.invoke(main, ["devices"])
    assert result.exit_code == 0
    for name in ("v100-16gb", "t4-16gb", "a100-40gb", "a100-80gb", "h100-80gb", "rtx-4090-24gb"):
        assert name in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    data = json.loads(runner.invoke(main, ["devices", "--json"]).output)
    assert data["a100-40gb"]["peak_flops"]["bf16"] == 312e12
    assert all(p["sources"] for p in data.values())


_FLAKY_ENTRY = '''
import torch

class Flaky(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        return h.exp() if self.calls % 2 else h

def make_step():
    m = Flaky()
    return m, torch.randn(2, 4), lambda out, batch: out.sum(), torch.optim.SGD(m.parameters(), lr=0.1)
'''


def test_steps_that_differ_are_reported(runner, tmp_path, monkeypatch):
    (tmp_path / "flaky_entry.py").write_text(_FLAKY_ENTRY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = runner.invoke(main, ["record", "--entry", "flaky_entry:make_step", "-o", str(tmp_path / "t")])
    assert result.exit_code == 0, result.output
    assert "Warning: the recorded steps differ" in result.output
    meta = read_trace(tmp_path / "t").meta
    assert meta["steps_match"] is False
    mm = meta["first_mismatch"]
    assert mm["step"] == 2 and "aten.exp.default in <top level>" in mm["expected"] + mm["got"]
    assert len(set(meta["signatures"])) == 2


@pytest.mark.parametrize(("entry", "fake", "expected"), [
    ("tiny_models:raises_in_forward", False, "ValueError: shapes (4, 8) and (7, 8) do not match (in forward"),
    ("tiny_models:reads_values", True, "called from forward"),
])
def test_a_step_that_raises_says_where_without_a_traceback(runner, tmp_path, entry, fake, expected):
    """The model's own error (or a value read under --fake) is the user's to fix: a one-paragraph
    message naming the exception and where it was raised, exit code 7, nothing written."""
    out = tmp_path / "t"
    r = runner.invoke(main, ["record", "--entry", entry, *(["--fake"] if fake else []), "-o", str(out)])
    assert r.exit_code == WorkloadError.exit_code, r.output
    msg = " ".join(r.output.split())
    assert "the training step raised" in msg and expected in msg, msg
    assert not fake or "it must not read tensor values" in msg
    assert "Traceback" not in r.output and not out.exists()
