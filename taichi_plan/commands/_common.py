"""Pieces several commands share: error handling, the ``--units`` flag, model sizing flags
and a transient status line. Nothing here imports ``taichi_plan.cli`` (which imports the
commands), so ``import taichi_plan.commands`` works on its own."""

from __future__ import annotations

import functools
import sys
import textwrap

import click

from ..errors import OutputError, TaichiError

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


class Status:
    """A transient rich status line on stderr, only when stderr is a terminal; call it (or
    ``update``) with a message."""

    def __init__(self, label: str):
        self._status = None
        if sys.stderr.isatty():
            from rich.console import Console

            self._status = Console(stderr=True).status(label, refresh_per_second=10)

    def __enter__(self):
        if self._status is not None:
            self._status.__enter__()
        return self

    def __exit__(self, *exc):
        if self._status is not None:
            self._status.__exit__(*exc)

    def update(self, message: str) -> None:
        if self._status is not None:
            self._status.update(message)

    __call__ = update
