"""The ``taichi-plan`` command line: a thin face over the library.

Each command lives in ``taichi_plan/commands/<name>.py``: it parses, calls one library
function and prints. Every :class:`~taichi_plan.errors.TaichiError` becomes a one-paragraph
message on stderr and the error's exit code.
"""

from __future__ import annotations

import functools
import sys
import textwrap

import click

from . import __version__
from .errors import TaichiError


def handle_errors(fn):
    """Turn library errors into a clear message and a non-zero exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TaichiError as e:
            msg = str(e) if "\n" in str(e) else textwrap.fill(
                str(e), width=88, break_on_hyphens=False, break_long_words=False)
            click.echo(f"Error: {msg}", err=True)
            sys.exit(e.exit_code)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="taichi-plan")
def main() -> None:
    """Plan the memory of a PyTorch training step: record it, solve a plan, inspect it."""


def _register() -> None:
    from .commands import COMMANDS

    for cmd in COMMANDS:
        main.add_command(cmd)


_register()
