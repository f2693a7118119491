"""Byte quantities: parsing budgets and printing sizes.

``16GB`` is 16x10^9 bytes, ``16GiB`` is 16x2^30 bytes, ``60%`` is 60% of a reference
(the trace's baseline peak). Plain integers are bytes; a plain number that is surely not
meant as bytes (a fraction such as ``0.6``, or a count far below the baseline peak such as
``60``) is refused with a hint (``60%``?) rather than read as a tiny budget.
"""

from __future__ import annotations

import math
import re

from .errors import BudgetError

_DECIMAL = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_UNITS = {**_DECIMAL, **_BINARY}
_BUDGET_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(%|[A-Za-z]*)$")

# A plain byte count below this fraction of the baseline peak is taken for a slip (``60``
# meant as 60%): no training step fits in a thousandth of its own peak.
TINY_FRACTION_OF_PEAK = 1e-3

_HELP = (
    "Write a budget as a number and a unit with no space: 16GB (16x10^9 bytes), "
    "16GiB (16x2^30 bytes), 512MB, 60% (of the trace's baseline peak) or plain bytes."
)


def parse_budget(text: str, baseline_peak_bytes: int | None = None) -> int:
    """Return the budget in bytes. ``baseline_peak_bytes`` is needed for percentages."""
    raw = str(text).strip()
    if raw != str(text) or " " in raw:
        raise BudgetError(f"Budget {text!r} has a space in it. {_HELP}")
    if raw.startswith("-"):
        raise BudgetError(f"Budget {text!r} is negative; a memory budget must be positive. {_HELP}")
    m = _BUDGET_RE.match(raw)
    if not m:
        raise BudgetError(f"Budget {text!r} is not a size. {_HELP}")
    number = float(m.group(1))
    unit = m.group(2)
    if not math.isfinite(number):
        raise BudgetError(f"Budget {text!r} is not a finite number. {_HELP}")
    if unit == "%":
        if baseline_peak_bytes is None:
            raise BudgetError(f"Budget {text!r} is a percentage but there is no baseline peak to take it of.")
        if number <= 0 or number > 100:
            raise BudgetError(
                f"Budget {text!r} is outside (0%, 100%]; a percentage is of the trace's baseline "
                "peak, and above 100% no planning is needed."
            )
        nbytes = baseline_peak_bytes * number / 100.0
    elif not unit:
        _check_plain_number(str(text), number, baseline_peak_bytes)
        nbytes = number
    else:
        key = unit.upper()
        if key not in _UNITS:
            raise BudgetError(f"Budget {text!r} has unknown unit {unit!r}. {_HELP}")
        nbytes = number * _UNITS[key]
    if not math.isfinite(nbytes) or nbytes >= 2**62:
        raise BudgetError(f"Budget {text!r} is too large to be a memory size. {_HELP}")
    result = int(nbytes)
    if result <= 0:
        raise BudgetError(f"Budget {text!r} is zero; a memory budget must be positive. {_HELP}")
    return result


def _check_plain_number(text: str, number: float, baseline_peak_bytes: int | None) -> None:
    """A number without a unit is bytes; refuse the ones that are surely meant otherwise."""
    if number != int(number):
        if number < 1:
            hint = f"Did you mean {number * 100:g}% (of the trace's baseline peak)?"
        elif number <= 100:
            hint = f"Did you mean {number:g}% (of the trace's baseline peak)?"
        else:
            hint = "Give a whole number of bytes, or a unit."
        raise BudgetError(
            f"Budget {text!r} is a plain number with a fraction, but a number without a unit is a "
            f"count of bytes. {hint} {_HELP}"
        )
    if baseline_peak_bytes is not None and 0 < number < baseline_peak_bytes * TINY_FRACTION_OF_PEAK:
        guess = f"{number:g}%" if number <= 100 else f"{number:g}MB or {number:g}GB"
        raise BudgetError(
            f"Budget {text!r} is {int(number)} bytes, less than a thousandth of the trace's baseline "
            f"peak ({format_bytes(baseline_peak_bytes)}): a number without a unit is a count of "
            f"bytes. Did you mean {guess}? {_HELP}"
        )


def format_bytes(nbytes: float, unit: str = "auto") -> str:
    """``format_bytes(1.5e9) == '1.50 GB'``; ``unit`` may be GB, GiB, MB, MiB or auto (decimal)."""
    if unit == "auto":
        for name in ("TB", "GB", "MB", "KB"):
            if abs(nbytes) >= _DECIMAL[name]:
                return f"{nbytes / _DECIMAL[name]:.2f} {name}"
        return f"{int(nbytes)} B"
    key = unit.upper()
    if key not in _UNITS:
        raise BudgetError(f"Unknown unit {unit!r}; use one of GB, GiB, MB, MiB, auto.")
    label = unit if key in _DECIMAL else key[:-2] + "iB"
    return f"{nbytes / _UNITS[key]:.2f} {label}"


def unit_scale(unit: str) -> tuple[float, str]:
    """(bytes per unit, label) for axis labels; unit is GB, GiB, MB, MiB."""
    key = unit.upper()
    if key not in _UNITS or key == "B":
        raise BudgetError(f"Unknown unit {unit!r}; use one of GB, GiB, MB, MiB.")
    label = unit.upper() if key in _DECIMAL else key[:-2] + "iB"
    return float(_UNITS[key]), label


def format_cost(cost: float, unit: str = "s") -> str:
    """Compute cost for people: seconds as s/ms/us; imported graphs' abstract units as is."""
    if unit != "s":
        return f"{cost:,.0f} units" if abs(cost) >= 1e4 else f"{cost:.4g} units"
    a = abs(cost)
    if a >= 1000:
        return f"{cost:,.0f} s"
    if a >= 1 or a == 0:
        return f"{cost:.3g} s"
    if a >= 1e-3:
        return f"{cost * 1e3:.3g} ms"
    return f"{cost * 1e6:.3g} us"
