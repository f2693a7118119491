"""One module per CLI command; ``COMMANDS`` is the list ``cli.main`` registers."""

from __future__ import annotations

import importlib

_MODULES = ["record", "devices", "import_graph", "inspect", "solve"]

COMMANDS = []
for _name in _MODULES:
    try:
        _mod = importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _e:  # a command module not written yet
        if _e.name != f"{__name__}.{_name}":
            raise
        continue
    COMMANDS.append(_mod.command)
