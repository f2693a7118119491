"""The HTML report's template, style and script are package data: they are files in the
package, an installed (non-editable) wheel carries them, and a page written from that wheel
is still self-contained."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest
from synthetic import chain_trace

import taichi_plan
from taichi_plan.plan.format import save_plan
from taichi_plan.report import html as html_report
from taichi_plan.solve import solve
from taichi_plan.trace.format import read_trace, write_trace

ASSETS = ("report.html", "report.css", "report.js")
REPO = Path(taichi_plan.__file__).parent.parent


def test_assets_are_package_files_inlined_in_the_page(tmp_path):
    folder = resources.files("taichi_plan.report") / "assets"
    for name in ASSETS:
        assert (folder / name).is_file(), name
    css, js = html_report.asset("report.css"), html_report.asset("report.js")
    assert "dl.kv" in css and "plan-data" in js
    trace = read_trace(write_trace(chain_trace([1000, 1200, 800, 1000], temp_bytes=200), tmp_path / "c"))
    ppath = save_plan(solve(trace, 10**9, "heuristic"), tmp_path / "c.plan.json")
    page = html_report.write_plan_html(ppath, tmp_path / "r.html").read_text(encoding="utf-8")
    assert f"<style>{css}</style>" in page and f"<script>{js}</script>" in page
    assert "${" not in page  # every placeholder filled
    # html.py keeps Python: no page, style or script in a string any more
    source = Path(html_report.__file__).read_text()
    assert "<!DOCTYPE" not in source and "getElementById" not in source and len(source.splitlines()) < 400


def test_wheel_carries_the_assets_and_writes_a_self_contained_page(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO / "taichi_plan", src / "taichi_plan", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True, cwd=src)
    assert res.returncode == 0, res.stderr
    wheel = next((tmp_path / "dist").glob("taichi_plan-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for name in ASSETS:
        assert f"taichi_plan/report/assets/{name}" in names, names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel installed is its files
    trace = read_trace(write_trace(chain_trace([1000, 1200, 800, 1000], temp_bytes=200), tmp_path / "c"))
    ppath = save_plan(solve(trace, 10**9, "heuristic"), tmp_path / "c.plan.json")
    out = tmp_path / "r.html"
    script = ("import taichi_plan, sys; from taichi_plan.report.html import write_plan_html; "
              f"write_plan_html({str(ppath)!r}, {str(out)!r}); print(taichi_plan.__file__)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).is_relative_to(site)  # the wheel's copy, not the checkout
    page = out.read_text(encoding="utf-8")
    assert page.count("<script") == 2 and "dl.kv" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"<link\b|@import|url\(", page, re.I)


def test_a_missing_asset_is_a_clear_error():
    from taichi_plan.base.errors import UsageError

    with pytest.raises(UsageError, match="reinstall"):
        html_report.asset("missing.css")
