"""The docs' benchmark tables, generated from the result files in benchmarks/results/.

    python benchmarks/report.py            # rewrite the tables of docs/benchmarks.md in place
    python benchmarks/report.py --check    # exit 1 when the page and the result files disagree

A table the results feed sits between two comments, naming the script and the table of its
result files (benchmarks/result_file.py) and, optionally, a glob over their file names:

    <!-- results: gpu_peer step -->
    | contender | s/step | ... | source |
    |---|---:|...|---|
    <!-- /results -->

Its rows are, in order, every row of that table in every matching file under
benchmarks/results/<script>/ (sorted by name: by date), each with the file as its `source`
cell; then the rows already there whose source is `untraced`, kept as written (figures from
before result files existed, to be rerun). `<!-- results: untraced -->` marks a table that no
script records yet: all its rows must be untraced.

`--check` fails, naming the table and the row, when a generated table differs from the page
(a figure edited by hand, a result file added or removed), when a table row of the page sits
outside such a block, when an untraced row has the wrong number of cells, and when a result
file is quoted by no table (a result is committed with the docs change that quotes it).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:  # imported as benchmarks.report (the tests)
    from benchmarks.result_file import SEPARATOR, split_row
except ImportError:  # run as a script: its folder is on the path
    from result_file import SEPARATOR, split_row

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"
RESULTS_DIR = REPO / "benchmarks" / "results"
UNTRACED = "untraced"
OPEN = re.compile(r"^<!--\s*results:\s*(\S+)(?:\s+(\S+))?(?:\s+(\S+))?\s*-->\s*$")
CLOSE = re.compile(r"^<!--\s*/results\s*-->\s*$")


@dataclass
class Block:
    """One marked table of the page: lines [start, end) between its two comments."""

    script: str
    table: str | None
    pattern: str
    start: int
    end: int
    lines: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.script if self.table is None else f"{self.script} {self.table}"


def join_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def find_blocks(lines: list[str]) -> tuple[list[Block], list[str]]:
    """(the marked tables, problems: unclosed or nested markers, table rows outside a block)."""
    blocks, problems, current = [], [], None
    for i, line in enumerate(lines):
        if m := OPEN.match(line):
            if current is not None:
                problems.append(f"line {i + 1}: a results block opens inside the one of line {current.start}")
            script, table, pattern = m.group(1), m.group(2), m.group(3) or "*"
            if script != UNTRACED and table is None:
                problems.append(f"line {i + 1}: `results: {script}` names no table")
            current = Block(script, table, pattern, i + 1, i + 1)
        elif CLOSE.match(line):
            if current is None:
                problems.append(f"line {i + 1}: `/results` closes no block")
                continue
            current.end = i
            current.lines = lines[current.start : i]
            blocks.append(current)
            current = None
        elif line.lstrip().startswith("|") and current is None:
            problems.append(
                f"line {i + 1}: a table row outside a `<!-- results: ... -->` block: {line.strip()[:80]}"
            )
    if current is not None:
        problems.append(f"line {current.start}: the results block is never closed")
    return blocks, problems


def result_files(results_dir: Path, script: str, table: str, pattern: str) -> list[tuple[Path, dict]]:
    folder = results_dir / script
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if not fnmatch.fnmatch(path.name, pattern):
            continue
        body = json.loads(path.read_text())
        if table in body.get("tables", {}):
            found.append((path, body["tables"][table]))
    return found


def generate(block: Block, results_dir: Path) -> tuple[list[str], list[str], list[Path]]:
    """(the block's lines as the results make them, problems, the result files quoted)."""
    problems = []
    rows = [line for line in block.lines if line.strip()]
    if len(rows) < 2 or not SEPARATOR.match(rows[1]):
        return block.lines, [f"table `{block.name}` (line {block.start}): no Markdown table header"], []
    header, separator = split_row(rows[0]), rows[1]
    untraced = []
    for i, line in enumerate(rows[2:]):
        cells = split_row(line)
        if cells[-1] == UNTRACED:
            if len(cells) != len(header):
                problems.append(
                    f"table `{block.name}`: untraced row {i + 1} has {len(cells)} cells, the header "
                    f"{len(header)}: {line.strip()[:80]}"
                )
            untraced.append(line.rstrip())
    if header[-1] != "source":
        problems.append(f"table `{block.name}` (line {block.start}): its last column must be `source`")
    if block.script == UNTRACED:
        return [*rows[:2], *untraced], problems, []

    files = result_files(results_dir, block.script, block.table, block.pattern)
    traced = []
    for path, table in files:
        want = [*table["header"], "source"]
        if want != header:
            header, separator = want, "|" + "---|" * len(want)
        source = f"`{path.relative_to(results_dir).as_posix()}`"
        traced += [join_row([*cells, source]) for cells in table["rows"]]
    return [join_row(header), separator, *traced, *untraced], problems, [p for p, _ in files]


def render(text: str, results_dir: Path = RESULTS_DIR) -> tuple[str, list[str], set[Path]]:
    """(the page with every marked table regenerated, problems, the result files quoted)."""
    lines = text.splitlines()
    blocks, problems = find_blocks(lines)
    quoted: set[Path] = set()
    out, at = [], 0
    for block in blocks:
        new, block_problems, files = generate(block, results_dir)
        problems += block_problems
        quoted.update(files)
        out += lines[at : block.start] + new
        at = block.end
    out += lines[at:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else ""), problems, quoted


def differences(old: str, new: str) -> list[str]:
    """Each marked table of `old` whose lines `new` changes, with its first differing row."""
    old_blocks, _ = find_blocks(old.splitlines())
    new_blocks, _ = find_blocks(new.splitlines())
    found = []
    for before, after in zip(old_blocks, new_blocks):
        a = [line.rstrip() for line in before.lines if line.strip()]
        b = [line.rstrip() for line in after.lines if line.strip()]
        if a == b:
            continue
        for k in range(max(len(a), len(b))):
            x = a[k] if k < len(a) else "(no row)"
            y = b[k] if k < len(b) else "(no row)"
            if x != y:
                found.append(
                    f"table `{before.name}` (line {before.start + 1 + k}) differs from its results:\n"
                    f"  page:    {x}\n  results: {y}"
                )
                break
    return found


def unquoted(results_dir: Path, quoted: set[Path]) -> list[str]:
    every = sorted(results_dir.glob("*/*.json")) if results_dir.is_dir() else []
    return [
        f"result file {p.relative_to(results_dir).as_posix()} is quoted by no table of the page"
        for p in every
        if p not in quoted
    ]


def check(page: Path = PAGE, results_dir: Path = RESULTS_DIR) -> list[str]:
    """Every disagreement between `page` and `results_dir`; empty when they agree."""
    text = page.read_text()
    new, problems, quoted = render(text, results_dir)
    return problems + differences(text, new) + unquoted(results_dir, quoted)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail when the page and the results disagree")
    ap.add_argument("--page", type=Path, default=PAGE, help=argparse.SUPPRESS)
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.page, args.results)
        for problem in problems:
            print(f"{args.page.name}: {problem}", file=sys.stderr)
        if problems:
            print("run `python benchmarks/report.py` to regenerate the tables", file=sys.stderr)
        return 1 if problems else 0
    text = args.page.read_text()
    new, problems, quoted = render(text, args.results)
    for problem in problems + unquoted(args.results, quoted):
        print(f"{args.page.name}: {problem}", file=sys.stderr)
    if new != text:
        args.page.write_text(new)
        print(f"rewrote the tables of {args.page}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
