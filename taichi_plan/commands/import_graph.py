"""``taichi-plan import-graph FILE``: a public benchmark graph (node-link JSON) -> a trace."""

from __future__ import annotations

from pathlib import Path

import click

from ..cli import handle_errors
from ..import_graph import import_graph
from ..trace import baseline_peak, write_trace
from ..units import format_bytes

DEFAULT_DIR = Path("traces")


@click.command("import-graph")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Trace directory to write [default: traces/<file stem>].")
@click.option("--force", is_flag=True, help="Overwrite the output if it exists.")
@handle_errors
def command(file: Path, output: Path | None, force: bool) -> None:
    """Import a Checkmate/Moccasin benchmark graph (node-link JSON) as a trace."""
    trace = import_graph(file)
    if output is None:
        DEFAULT_DIR.mkdir(exist_ok=True)
        output = DEFAULT_DIR / file.stem
    path = write_trace(trace, output, force=force)
    peak_bytes, peak_op = baseline_peak(trace)
    click.echo(f"Wrote {path} ({trace.num_ops} ops, baseline peak {format_bytes(peak_bytes)} at op {peak_op})")
