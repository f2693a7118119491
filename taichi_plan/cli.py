"""The ``taichi-plan`` command line: a thin face over the library.

Each command lives in ``taichi_plan/commands/<name>.py``: it parses, calls one library
function and prints. Every :class:`~taichi_plan.base.errors.TaichiError` becomes a one-paragraph
message on stderr and the error's exit code (``commands/_common.handle_errors``).
"""

from __future__ import annotations

import click

from .base.version import __version__
from .commands._common import handle_errors

__all__ = ["handle_errors", "main"]  # handle_errors lives in commands/_common.py; kept here for callers


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="taichi-plan")
def main() -> None:
    """Plan the memory of a PyTorch training step: record it, solve a plan, inspect it."""


def _register() -> None:
    from .commands import COMMANDS

    for cmd in COMMANDS:
        main.add_command(cmd)


_register()
