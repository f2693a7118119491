"""One module per CLI command; ``COMMANDS`` is the list ``cli.main`` registers."""

from __future__ import annotations

from . import compare, devices, import_graph, inspect, maxbatch, record, replay, solve

COMMANDS = [m.command for m in (record, import_graph, inspect, devices, solve, compare, maxbatch, replay)]
