"""The README is tested: every command its fenced blocks show runs here, in order.

How it works:

- README.md is parsed at collection: each fenced block is either ``python`` (a snippet, run
  with ``exec``) or plain, where every line is a ``taichi-plan ...`` command, a ``make
  TARGET`` line (checked to be a Makefile target, not run: ``make test`` would run this very
  suite), or a comment. Any other line or block language fails ``test_readme_is_understood``:
  the README cannot show something this file does not run.
- Each command becomes one test case, in README order, all sharing one working directory
  (``repo/``, holding a symlink to the real ``examples/``, beside ``shared/graphs`` linked to
  the public graphs of ``conftest.graphs_path()``), so a later command reads what an earlier
  one wrote. Run the whole file: ``-k`` on one case loses what the cases before it wrote.
- Commands run in-process through click's CliRunner; each must exit 0, and each written
  output must be announced by a ``Wrote PATH`` line naming a path that exists (for ``-o``,
  ``--png`` and ``--html``, that very path).
- Slow commands run smaller, through ``SUBSTITUTIONS`` below: each entry is applied as a
  plain text replacement and must match at least one README command (a stale entry fails).
- Without the public graphs, the ``import-graph`` line is skipped, and so is every later
  command that names what it would have written; nothing else is ever skipped.
- ``PENDING`` marks the README commands that need a change another branch makes (xfail, not
  strict, until it lands); each must name a README command.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import REPO_ROOT, graphs_path

from taichi_plan.cli import main

README = REPO_ROOT / "README.md"
MAKEFILE = REPO_ROOT / "Makefile"

# README text -> what the test runs instead, and why. Plain text replacement, in this order.
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    ("--model gpt2 --batch 8 --seq 1024 --fake", "--model gpt2 --batch 8 --seq 1024 --layers 2 --fake",
     "GPT-2 small has 12 layers (1805 ops, 10 s to trace); 2 layers give 355 ops"),
    ("traces/gpt2-b8 --budget 12GB", "traces/gpt2-b8 --budget 6GB --time-limit 2",
     "the 2-layer trace peaks at 7.18 GB, under 12 GB: 6 GB keeps the budget binding; a bounded search"),
    ("traces/gpt2-b8 --budget 60%", "traces/gpt2-b8 --budget 80%",
     "no plan of the 2-layer trace goes below 69% of its peak (its logits' backward)"),
    ("--time-limit 120", "--time-limit 2", "the ILP's search, bounded"),
    ("--sweep 0.9,0.8,0.6,0.4", "--sweep 0.8,0.5 --time-limit 2",
     "two budgets, auto and ilp 2 s each instead of 30"),
    ("maxbatch --model gpt2 --seq 1024 --budget 16GB",
     "maxbatch --model gpt2 --seq 1024 --layers 2 --budget 3GB --time-limit 2",
     "each batch size tried is a fake step: 2 layers, and a budget that 4 batch sizes settle"),
    ("--steps 5", "--steps 1", "replay: one timed step per run"),
    ("--steps 3", "--steps 1", "replay of the accumulation loop: one timed step per run"),
    ("tiny-gpt2-accum --budget 80%", "tiny-gpt2-accum --budget 80% --work-limit 1", "a search bounded by its work"),
    ("traces/tiny-gpt2 --budget 70%", "traces/tiny-gpt2 --budget 70% --work-limit 1",
     "auto searches its whole default 60 s when it cannot prove optimality"),
]
PYTHON_SUBSTITUTIONS: list[tuple[str, str, str]] = [
    ("time_limit=60", "time_limit=60, work_limit=1", "the snippet's solve, bounded by its work"),
]

# README command -> the change on another branch it needs (xfail until that change is merged).
PENDING: dict[str, str] = {}

# Commands that write something and must say so with a `Wrote PATH` line.
WRITERS = {"record", "import-graph", "solve", "replay"}
PATH_FLAGS = ("-o", "--output", "--png", "--html")


@dataclass(frozen=True)
class Step:
    line: int        # line in README.md where it starts
    kind: str        # "cli" or "python"
    text: str        # as the README shows it (comments dropped for cli)

    @property
    def id(self) -> str:
        what = self.text.split()[1] if self.kind == "cli" else "python"
        return f"L{self.line}-{what}"


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", MAKEFILE.read_text(), flags=re.M))


def parse_readme(text: str) -> tuple[list[Step], list[str]]:
    """The README's steps in order, and every line or block this test does not understand."""
    steps: list[Step] = []
    problems: list[str] = []
    targets = _makefile_targets()
    commands = set(main.commands)
    for m in re.finditer(r"^```([^\n]*)\n(.*?)^```[ \t]*$", text, flags=re.M | re.S):
        lang, body = m.group(1).strip(), m.group(2)
        first = text.count("\n", 0, m.start(2)) + 1
        if lang == "python":
            steps.append(Step(first, "python", body))
            continue
        if lang:
            problems.append(f"README.md:{first - 1}: a ```{lang} block; only ``` and ```python are run")
            continue
        lines = body.splitlines()
        i = 0
        while i < len(lines):
            start, line = first + i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError as e:
                problems.append(f"README.md:{start}: cannot split {line!r}: {e}")
                continue
            if not tokens:
                continue  # blank or comment
            if tokens[0] == "make":
                missing = [t for t in tokens[1:] if t not in targets]
                if len(tokens) < 2 or missing:
                    problems.append(f"README.md:{start}: {line.strip()!r}: no such Makefile target {missing}")
                continue
            if tokens[0] == "taichi-plan" and len(tokens) > 1 and tokens[1] in commands:
                steps.append(Step(start, "cli", shlex.join(tokens)))
                continue
            problems.append(f"README.md:{start}: not a taichi-plan command or make target: {line.strip()!r}")
    return steps, problems


STEPS, PROBLEMS = parse_readme(README.read_text())


def _substitute(text: str, table: list[tuple[str, str, str]]) -> str:
    for old, new, _why in table:
        text = text.replace(old, new)
    return text


def test_readme_is_understood():
    """Every line of every fenced block is run or deliberately not; every substitution and
    PENDING mark still matches the README."""
    assert not PROBLEMS, "README.md shows what tests/test_readme.py does not run:\n" + "\n".join(PROBLEMS)
    cli = [s.text for s in STEPS if s.kind == "cli"]
    python = [s.text for s in STEPS if s.kind == "python"]
    assert cli and python
    for old, _new, why in SUBSTITUTIONS:
        assert any(old in c for c in cli), f"substitution {old!r} ({why}) matches no README command"
    for old, _new, why in PYTHON_SUBSTITUTIONS:
        assert any(old in p for p in python), f"substitution {old!r} ({why}) matches no README snippet"
    for cmd in PENDING:
        assert cmd in cli, f"PENDING names {cmd!r}, which the README no longer shows"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("readme")
    repo = root / "repo"
    repo.mkdir()
    (repo / "examples").symlink_to(REPO_ROOT / "examples", target_is_directory=True)
    graphs = graphs_path()
    if graphs.is_dir():
        (root / "shared").mkdir()
        (root / "shared" / "graphs").symlink_to(graphs.resolve(), target_is_directory=True)
    return {"repo": repo, "skipped_outputs": []}


def _flag_values(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in PATH_FLAGS]


def _params():
    for s in STEPS:
        marks = []
        if s.kind == "cli" and s.text in PENDING:
            marks.append(pytest.mark.xfail(reason=PENDING[s.text], strict=False))
        yield pytest.param(s, id=s.id, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("step", list(_params()))
def test_readme_step(step: Step, workdir: dict, monkeypatch):
    repo: Path = workdir["repo"]
    monkeypatch.chdir(repo)
    if step.kind == "python":
        monkeypatch.syspath_prepend(str(repo))
        code = _substitute(step.text, PYTHON_SUBSTITUTIONS)
        exec(compile(code, f"{README}:{step.line}", "exec"), {"__name__": "__readme__"})
        return

    argv = shlex.split(_substitute(step.text, SUBSTITUTIONS))[1:]
    for name in workdir["skipped_outputs"]:
        if any(name in a for a in argv):
            pytest.skip(f"needs {name}, which the skipped import-graph line would have written")
    if argv[0] == "import-graph" and not (repo / argv[1]).is_file():
        workdir["skipped_outputs"].extend(Path(v).name for v in _flag_values(argv))
        pytest.skip(f"public benchmark graph {argv[1]} not found (conftest.graphs_path(); "
                    "set TAICHI_GRAPHS_DIR)")

    result = CliRunner().invoke(main, argv)
    out = result.output
    assert result.exit_code == 0, f"`{shlex.join(['taichi-plan', *argv])}` exited {result.exit_code}:\n{out}" + (
        "" if result.exception is None or isinstance(result.exception, SystemExit) else f"\n{result.exception!r}")
    wrote = re.findall(r"^Wrote (\S+)", out, flags=re.M)
    if argv[0] in WRITERS:
        assert wrote, f"`{step.text}` wrote nothing it announced:\n{out}"
    for path in _flag_values(argv):
        assert path in wrote, f"`{step.text}`: no `Wrote {path}` line:\n{out}"
    for path in wrote:
        assert (repo / path).exists(), f"`{step.text}` says it wrote {path}, which does not exist"
