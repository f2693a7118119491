"""Budgets: decimal and binary units, percentages of the baseline peak, and clear errors."""

from __future__ import annotations

import pytest

from taichi_plan.base.errors import BudgetError
from taichi_plan.base.units import format_bytes, parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GB", 16 * 10**9),
        ("16GiB", 16 * 2**30),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("16gb", 16 * 10**9),
        ("4096", 4096),
        ("2KB", 2000),
    ],
)
def test_sizes(text, expected):
    assert parse_budget(text) == expected


def test_percent_of_baseline():
    assert parse_budget("60%", baseline_peak_bytes=10**9) == 600_000_000
    assert parse_budget("100%", baseline_peak_bytes=12345) == 12345
    assert parse_budget("12.5%", baseline_peak_bytes=800) == 100


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("16 GB", "space"),
        ("-3GB", "negative"),
        ("0", "zero"),
        ("0GB", "zero"),
        ("1e999", "finite"),
        ("abc", "not a size"),
        ("16XB", "unknown unit"),
        ("", "not a size"),
    ],
)
def test_errors(text, message):
    with pytest.raises(BudgetError, match=message) as e:
        parse_budget(text, baseline_peak_bytes=10**9)
    assert "16GB" in str(e.value) or "%" in str(e.value)


def test_percent_errors():
    with pytest.raises(BudgetError, match=r"outside \(0%, 100%\]"):
        parse_budget("150%", baseline_peak_bytes=10**9)
    with pytest.raises(BudgetError, match=r"outside \(0%, 100%\]"):
        parse_budget("0%", baseline_peak_bytes=10**9)
    with pytest.raises(BudgetError, match="no baseline peak"):
        parse_budget("60%")
    with pytest.raises(BudgetError, match="not a size"):
        parse_budget("%", baseline_peak_bytes=10**9)


def test_too_large():
    with pytest.raises(BudgetError, match="too large"):
        parse_budget("1e30GB")


def test_budget_error_exit_code():
    assert BudgetError.exit_code == 4


def test_format_bytes():
    assert format_bytes(1.5e9) == "1.50 GB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(2**30, "GiB") == "1.00 GiB"
    assert format_bytes(5 * 10**6, "MB") == "5.00 MB"
    with pytest.raises(BudgetError):
        format_bytes(1, "furlongs")


@pytest.mark.parametrize(("text", "hint"), [("0.6", "60%"), ("0.35", "35%"), ("12.5", "12.5%")])
def test_plain_fraction_is_refused_with_a_percent_hint(text, hint):
    # A plain number is bytes: 0.6 used to be read as 0 bytes ("is zero"), 12.5 as 12 bytes.
    for peak in (None, 10**9):
        with pytest.raises(BudgetError) as e:
            parse_budget(text, baseline_peak_bytes=peak)
        msg = str(e.value)
        assert f"Did you mean {hint}" in msg and "zero" not in msg


def test_plain_count_far_below_the_peak_asks_whether_percent_was_meant():
    with pytest.raises(BudgetError) as e:
        parse_budget("60", baseline_peak_bytes=10**9)
    assert "60 bytes" in str(e.value) and "Did you mean 60%?" in str(e.value)
    with pytest.raises(BudgetError, match="Did you mean 4096MB or 4096GB"):
        parse_budget("4096", baseline_peak_bytes=10**9)
    # A plain count that is a sensible fraction of the peak is bytes, as before.
    assert parse_budget("300", baseline_peak_bytes=324) == 300
    assert parse_budget("2000000", baseline_peak_bytes=10**9) == 2_000_000
    # With units nothing is second-guessed.
    assert parse_budget("60KB", baseline_peak_bytes=10**9) == 60_000


def test_cli_budget_hint(tmp_path):
    from click.testing import CliRunner
    from synthetic import chain_trace

    from taichi_plan.cli import main
    from taichi_plan.trace.format import write_trace

    path = write_trace(chain_trace([10**6] * 4), tmp_path / "chain")
    for text, hint in (("0.6", "60%"), ("60", "60%")):
        r = CliRunner().invoke(main, ["solve", str(path), "--budget", text, "-o", str(tmp_path / "p.json")])
        assert r.exit_code == BudgetError.exit_code, r.output
        assert f"Did you mean {hint}" in " ".join(r.output.split()) and "Traceback" not in r.output
        assert not (tmp_path / "p.json").exists()
