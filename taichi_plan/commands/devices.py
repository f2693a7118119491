"""``taichi-plan devices``: list the device profiles fake recordings are costed against."""

from __future__ import annotations

import click

from ..trace.devices import PROFILES, profiles_json, profiles_table
from ._common import handle_errors


def _fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


@click.command("devices")
@click.option("--json", "as_json", is_flag=True, help="Print every profile with its sources as JSON.")
@handle_errors
def command(as_json: bool) -> None:
    """List device profiles: memory, peak dense TFLOP/s per dtype, bandwidth, host link, launch overhead."""
    if as_json:
        click.echo(profiles_json())
        return
    header = f"{'name':<14}{'memory':>9}{'fp32':>7}{'tf32':>7}{'fp16':>7}{'bf16':>7}{'GB/s':>7}{'host':>7}{'launch':>8}"
    click.echo(header)
    click.echo(f"{'':<14}{'GiB':>9}{'TFLOP/s (dense)':>28}{'':>7}{'GB/s':>7}{'us':>8}")
    for row in profiles_table():
        click.echo(
            f"{row['name']:<14}{_fmt(row['memory_gib'], 0):>9}{_fmt(row['fp32_tflops']):>7}"
            f"{_fmt(row['tf32_tflops']):>7}{_fmt(row['fp16_tflops']):>7}{_fmt(row['bf16_tflops']):>7}"
            f"{_fmt(row['bandwidth_gbs'], 0):>7}{_fmt(row['host_link_gbs'], 0):>7}{_fmt(row['launch_us'], 0):>8}"
        )
    click.echo(f"{len(PROFILES)} profiles; sources: taichi-plan devices --json")
