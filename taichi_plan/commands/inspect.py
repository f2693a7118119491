"""``taichi-plan inspect PATH``: what a trace directory (or, later, a plan file) holds."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..base.atomic import check_output, is_html, is_png
from ..base.errors import UsageError
from ..report.trace_text import render_trace_summary, trace_summary
from ..trace.format import read_trace
from ._common import handle_errors, units_option


def inspect_plan_file(path: Path, as_json: bool, units: str | None, png: Path | None = None,
                      force: bool = False) -> str:
    """Dispatch to the plan report (``taichi_plan.report.plan_text.inspect_plan``), which
    takes ``(path, as_json=..., units=..., png=..., force=...)`` and returns the text to print."""
    module = f"{__package__.rsplit('.', 1)[0]}.report.plan_text"
    try:
        from ..report.plan_text import inspect_plan
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name != module:
            raise
        missing = "is missing" if isinstance(e, ModuleNotFoundError) else "has no inspect_plan"
        raise UsageError(
            f"{str(path)!r} looks like a plan file, but this taichi-plan has no plan report yet "
            f"(module {module} {missing}). Inspect the trace directory the plan was solved for "
            "instead."
        ) from e
    return inspect_plan(path, as_json=as_json, units=units, png=png, force=force)


def _with_html(text: str, plan_path: Path, html_path: Path, as_json: bool, units: str | None,
               force: bool) -> str:
    """Write the plan's HTML report and say so: a ``Wrote`` line, or an ``html`` key in JSON."""
    from ..report.html import write_plan_html

    wrote = write_plan_html(plan_path, html_path, force=force, units=units)
    if as_json:
        summary = json.loads(text)
        summary["html"] = str(wrote)
        return json.dumps(summary, indent=1, ensure_ascii=False) + "\n"
    return text + f"Wrote {wrote}\n"


def inspect_trace_dir(path: Path, as_json: bool, units: str | None) -> str:
    summary = trace_summary(read_trace(path))
    if as_json:
        return json.dumps(summary, indent=1, ensure_ascii=False) + "\n"
    return render_trace_summary(summary, units)


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the facts as one JSON object.")
@units_option
@click.option("--png", type=click.Path(path_type=Path), default=None,
              help="For a plan: also draw its memory timeline (baseline vs planned) to this PNG file.")
@click.option("--html", "html_path", type=click.Path(path_type=Path), default=None,
              help="For a plan: also write a self-contained HTML report (timeline, decisions, modules) to this file.")
@click.option("--force", is_flag=True, help="Replace the --png or --html file if it exists (only a PNG or an HTML page, never other files).")
@handle_errors
def command(path: Path, as_json: bool, units: str | None, png: Path | None, html_path: Path | None,
            force: bool) -> None:
    """Show what a trace directory holds (ops, tensors, baseline peak, largest tensors) or
    what a plan file decides and why (PLAN.plan.json; --png draws its memory timeline,
    --html writes a report to open in a browser)."""
    if path.suffix == ".json" and not path.is_dir():  # a plan file, even a missing one
        if png is not None:
            check_output(png, force, what="PNG file", option="--png", owned=is_png)
        if html_path is not None:
            check_output(html_path, force, what="HTML file", option="--html", owned=is_html)
        text = inspect_plan_file(path, as_json, units, png, force)
        if html_path is not None:
            text = _with_html(text, path, html_path, as_json, units, force)
    else:
        if html_path is not None:
            raise UsageError(
                f"--html writes a plan's report, but {str(path)!r} is not a plan file. Solve the "
                "trace first (`taichi-plan solve TRACE --budget ...`) and inspect the plan file it "
                "writes."
            )
        if png is not None:
            raise UsageError(
                f"--png draws a plan's memory timeline, but {str(path)!r} is not a plan file. "
                "Solve the trace first (`taichi-plan solve TRACE --budget ...`) and inspect the "
                "plan file it writes."
            )
        text = inspect_trace_dir(path, as_json, units)
    click.echo(text, nl=False)
