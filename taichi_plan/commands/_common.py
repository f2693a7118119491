"""Pieces several commands share: model sizing flags and a transient status line."""

from __future__ import annotations

import sys

import click

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
