"""Pieces several commands share: error handling, the ``--units`` flag, model sizing flags
and progress on stderr (:class:`Status`). Nothing here imports ``taichi_plan.cli`` (which
imports the commands), so ``import taichi_plan.commands`` works on its own."""

from __future__ import annotations

import functools
import sys
import textwrap
import threading
import time

import click

from ..base.errors import OutputError, TaichiError

UNITS = ["GB", "GiB", "MB", "MiB", "auto"]  # byte units every --units flag offers


def _print_error(text: str) -> None:
    msg = text if "\n" in text else textwrap.fill(text, width=88, break_on_hyphens=False,
                                                   break_long_words=False)
    click.echo(f"Error: {msg}", err=True)


def handle_errors(fn):
    """Turn library errors into a clear one-paragraph message and a non-zero exit code.

    A :class:`TaichiError` prints its command-line phrasing (``cli_message``) and exits with
    its ``exit_code``. An ``OSError`` that escaped the library (every output write already
    becomes an :class:`OutputError`) is still a message, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TaichiError as e:
            _print_error(e.cli_message or str(e))
            sys.exit(e.exit_code)
        except OSError as e:
            where = f" ({e.filename!r})" if e.filename else ""
            _print_error(f"A file could not be read or written{where}: {e.strerror or e}. Check the path, "
                         "its permissions and the free space, then run the command again.")
            sys.exit(OutputError.exit_code)

    return wrapper


def _units_value(ctx, param, value: str | None) -> str | None:
    return None if value is None or value == "auto" else value


def units_option(fn):
    """``--units``: GB, GiB, MB, MiB or auto (the default); the command receives None for auto."""
    return click.option("--units", type=click.Choice(UNITS, case_sensitive=False), default=None,
                        callback=_units_value,
                        help="Unit for byte sizes [default: auto, decimal].")(fn)

SIZE_FLAGS = [
    ("--batch", int, "Batch size."),
    ("--seq", int, "Sequence length (text models)."),
    ("--image-size", int, "Image side in pixels (vision models)."),
    ("--layers", int, "Number of layers (blocks)."),
    ("--hidden", int, "Hidden size."),
    ("--heads", int, "Attention heads."),
    ("--vocab", int, "Vocabulary size (text models)."),
]


def size_options(batch: bool = True):
    """Decorator adding the model sizing flags (``--batch`` only when ``batch``)."""

    def decorate(fn):
        for flag, typ, help_text in reversed(SIZE_FLAGS):
            if flag == "--batch" and not batch:
                continue
            fn = click.option(flag, type=typ, default=None, help=help_text + " Default: the model's own.")(fn)
        return fn

    return decorate


PLAIN_INTERVAL_S = 10.0  # off a terminal: seconds between progress lines


class Status:
    """Progress of a long command, on stderr.

    On a terminal: a transient rich line, or a bar when ``total`` is given (refreshed at most
    10 times a second). Elsewhere (a pipe, a log file, CI): one plain line every ``interval_s``
    seconds (default :data:`PLAIN_INTERVAL_S`) saying what is being done and for how long, e.g.
    ``comparing: dtr at 1.20 GB (12/40), 30 s``; a command that ends sooner prints nothing.

    Call it (or :meth:`update`) with a message; :meth:`step` takes ``(done, total, message)``.
    ``timed=True`` counts elapsed seconds against ``total`` (a solver's time limit).
    """

    def __init__(self, label: str, total: float | None = None, *, timed: bool = False,
                 interval_s: float | None = None):
        self.label = label
        self.total = total
        self.timed = timed
        self.interval_s = PLAIN_INTERVAL_S if interval_s is None else interval_s
        self.message = ""
        self.done: float | None = None
        self._stream = sys.stderr
        self._tty = self._stream.isatty()
        self._live = None
        self._task = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()

    # -- terminal ---------------------------------------------------------------------------

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.markup import escape

        console = Console(stderr=True)
        if self.total is None:
            self._live = console.status(escape(self.label), refresh_per_second=10)
            self._live.__enter__()
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = [TextColumn(f"[bold]{escape(self.label)}[/] {{task.description}}"), BarColumn()]
        if not self.timed:
            columns.append(MofNCompleteColumn())
        columns.append(TimeElapsedColumn())
        self._live = Progress(*columns, console=console, transient=True, refresh_per_second=10)
        self._live.__enter__()
        self._task = self._live.add_task("", total=self.total)

    def _show(self) -> None:
        if self._live is None:
            return
        if self._task is None:
            self._live.update(f"{self.label}: {self.message}" if self.message else self.label)
        else:
            self._live.update(self._task, description=self.message, total=self.total,
                              completed=self.done or 0)

    # -- elsewhere ----------------------------------------------------------------------------

    def line(self) -> str:
        """The plain progress line for now: label, message, counts or seconds, elapsed."""
        elapsed = time.monotonic() - self._t0
        text = self.label + (f": {self.message}" if self.message else "")
        if self.timed and self.total:
            return f"{text} ({elapsed:.0f} s of {self.total:g} s)"
        if self.done is not None and self.total:
            text += f" ({self.done:g}/{self.total:g})"
        return f"{text}, {elapsed:.0f} s"

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                print(self.line(), file=self._stream, flush=True)
            except (OSError, ValueError):  # the stream was closed under us: stop quietly
                return

    # -- both -------------------------------------------------------------------------------

    def __enter__(self):
        self._t0 = time.monotonic()
        if self._tty:
            self._start_rich()
        if not self._tty or (self.timed and self._task is not None):
            self._thread = threading.Thread(target=self._tick_timed if self._tty else self._tick, daemon=True)
            self._thread.start()
        return self

    def _tick_timed(self) -> None:
        while not self._stop.wait(0.2):
            self.done = min(time.monotonic() - self._t0, self.total or 0.0)
            self._show()

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def update(self, message: str, done: float | None = None, total: float | None = None) -> None:
        self.message = message
        if total is not None:
            self.total = total
        if done is not None:
            self.done = done
        self._show()

    def step(self, done: float, total: float, message: str) -> None:
        """``progress(done, total, message)``, as :func:`taichi_plan.explore.compare.compare` calls it."""
        self.update(message, done, total)

    __call__ = update


def offload_options(fn):
    """``--offload``, ``--host-budget BYTES`` and ``--host-link GB/s`` (solve, maxbatch)."""
    fn = click.option("--host-link", "host_link", default=None, type=float, metavar="GB/s",
                      help="With --offload: the host link's bandwidth each way in GB/s [default: the trace's "
                           "device profile's, `taichi-plan devices`].")(fn)
    fn = click.option("--host-budget", "host_budget", default=None, metavar="BYTES",
                      help="With --offload: the host memory the offloaded copies may hold at most (16GB, 16GiB, "
                           "512MB) [default: no bound].")(fn)
    return click.option("--offload", is_flag=True,
                        help="Let our planners also offload saved activations: copied to host memory after their "
                             "last forward use and back before backward needs them, on copy streams, the copies "
                             "costed on the device profile's host link and their stalls counted in the extra "
                             "compute (docs/planner.md#offload).")(fn)


def offload_config(trace, offload: bool, host_budget: str | None, host_link: float | None):
    """The :class:`~taichi_plan.problem.offload.OffloadConfig` the flags ask for, or None without ``--offload``."""
    from ..base.errors import UsageError
    from ..base.units import parse_budget
    from ..problem.offload import OffloadConfig, host_link_of

    if not offload:
        if host_budget is not None or host_link is not None:
            raise UsageError("--host-budget and --host-link only apply with --offload; add --offload, or leave "
                             "them out.")
        return None
    if trace.meta.get("compiled") is not None:
        raise UsageError("--offload: this trace is of a torch.compile'd step, and a compiled step runs no "
                         "runtime beside it to copy tensors to host and back; solve it without --offload "
                         "(drops only), or record the step eagerly (without --compile) to plan offloads.")
    cap = None
    if host_budget is not None:
        if str(host_budget).strip().endswith("%"):
            raise UsageError(f"--host-budget {host_budget!r}: give bytes (16GB, 512MB), not a percentage.")
        cap = parse_budget(host_budget)
    bw = host_link_of(trace, None if host_link is None else host_link * 1e9)
    return OffloadConfig(bw, cap)
