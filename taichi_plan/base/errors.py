"""One exception hierarchy for every user-facing failure, each mapped to an exit code.

Messages say what was wrong, what was expected and what to do next. The CLI prints
the message as one paragraph and exits with ``exit_code``; library callers catch
:class:`TaichiError` (or a subclass) instead of parsing text.
"""

from __future__ import annotations


class TaichiError(Exception):
    """Base class: a problem the user can fix. ``exit_code`` is what the CLI returns.

    ``str(e)`` speaks to library callers (``force=True``); ``cli_message``, when set, is the
    same message for the command line (``--force``, ``-o``), which the CLI prints instead.
    """

    exit_code = 1

    def __init__(self, message: str = "", *, cli_message: str | None = None):
        super().__init__(message)
        self.cli_message = cli_message


class UsageError(TaichiError):
    """A flag or argument has a value the command cannot use."""

    exit_code = 2


class TraceError(TaichiError):
    """A trace directory is missing, truncated, malformed or of an unknown version."""

    exit_code = 3


class BudgetError(TaichiError):
    """A memory budget that does not parse or makes no sense (negative, zero, infinite)."""

    exit_code = 4


class InfeasibleBudgetError(TaichiError):
    """No plan reaches the budget; carries the smallest budget this trace can reach."""

    exit_code = 5

    def __init__(self, message: str, min_budget_bytes: int | None = None, op_id: int | None = None,
                 planned_peak_bytes: int | None = None):
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes  # lowest budget the heuristic is known to meet
        self.op_id = op_id
        self.planned_peak_bytes = planned_peak_bytes  # the failed method's own simulated peak


class PlanError(TaichiError):
    """A plan file that is malformed, of an unknown version, or made for another trace."""

    exit_code = 6


class WorkloadError(TaichiError):
    """A model name that is unknown, or a user ``--entry`` that does not import or is wrong."""

    exit_code = 7


class OutputExistsError(TaichiError):
    """The output path exists and ``force`` (``--force``) was not given."""

    exit_code = 8


class MismatchError(TaichiError):
    """The live op sequence differs from the one a plan or trace was made for."""

    exit_code = 9


class OutputError(TaichiError):
    """An output that cannot be written there: the location is not writable or not a
    directory, the path holds something this tool did not write (``force`` replaces only its
    own traces, plans and reports, never a directory of other files), or the write itself
    failed (disk full, permission denied)."""

    exit_code = 10


class NotEnoughMemoryError(TaichiError):
    """This machine has less memory than a run needs (``replay`` before it starts);
    ``--force`` tries anyway."""

    exit_code = 11

    def __init__(self, message: str, needed_bytes: int | None = None, available_bytes: int | None = None):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
