"""``taichi-plan import-graph FILE``: a public benchmark graph (node-link JSON) -> a trace."""

from __future__ import annotations

from pathlib import Path

import click

from ..base.units import format_bytes
from ..trace.format import baseline_peak, check_trace_output, write_trace
from ..trace.import_graph import import_graph
from ._common import handle_errors

DEFAULT_DIR = Path("traces")


@click.command("import-graph")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Trace directory to write [default: traces/<file stem>].")
@click.option("--force", is_flag=True, help="Replace an existing trace directory (only a trace, never other files).")
@handle_errors
def command(file: Path, output: Path | None, force: bool) -> None:
    """Import a Checkmate/Moccasin benchmark graph (node-link JSON) as a trace."""
    if output is None:
        output = DEFAULT_DIR / file.stem
    check_trace_output(output, force, option="-o")
    trace = import_graph(file)
    path = write_trace(trace, output, force=force)
    peak_bytes, peak_op = baseline_peak(trace)
    click.echo(f"Wrote {path} ({trace.num_ops} ops, baseline peak {format_bytes(peak_bytes)} at op {peak_op})")
