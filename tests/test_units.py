"""Budgets: decimal and binary units, percentages of the baseline peak, and clear errors."""

from __future__ import annotations

import pytest

from taichi_plan.errors import BudgetError
from taichi_plan.units import format_bytes, parse_budget


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
