"""Every published benchmark number, regenerated from ``benchmarks/results/*.json``.

    python benchmarks/report.py           # rewrite every generated block of the pages
    python benchmarks/report.py --check   # exit 1 naming each stale block and each unbacked README number

The pages are ``README.md``, ``benchmarks/README.md``, ``docs/benchmarks/*.md`` and any other docs
page that holds a block. A generated block is the text between ``<!-- report:NAME -->`` and
``<!-- /report -->``; its content is what the generator ``NAME`` (of one of the ``report_blocks*``
modules: :data:`GENERATORS`) makes from the result files, never typed. ``--check`` also reads
README.md outside generated blocks, fenced code, inline code and link targets: every number left
there must be in :data:`ALLOWED` (numbers that are not results: the quickstart's 100 clients, ...),
so a result typed into the prose fails the check; and a Markdown table row of another page (not
docs/benchmarks/index.md, which lists pages) outside a generated block or fenced code fails it,
naming the page and line.

A result file made before ``benchmarks/provenance.py`` carries no provenance: its line says
"(no provenance: made before <date>)", the date of the first commit that holds the file
(``git log --follow``), never invented.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import report_blocks  # noqa: E402
import report_blocks_goals  # noqa: E402
import report_blocks_mnist  # noqa: E402
import report_blocks_misc  # noqa: E402
import report_blocks_policy  # noqa: E402
import report_blocks_tuning  # noqa: E402
import report_blocks_wall  # noqa: E402

#: block name -> generator; each page's generators live in a module of their own
GENERATORS = {**report_blocks.GENERATORS, **report_blocks_mnist.GENERATORS, **report_blocks_policy.GENERATORS,
              **report_blocks_misc.GENERATORS, **report_blocks_goals.GENERATORS,
              **report_blocks_tuning.GENERATORS, **report_blocks_wall.GENERATORS}

ROOT = HERE.parent
BLOCK = re.compile(r"<!-- report:([\w-]+) -->\n(.*?)<!-- /report -->", re.S)

# Numbers README.md may state outside generated blocks: none of them is a measured result.
ALLOWED = {
    "100": "the quickstart's clients (a setting)",
    "10": "FedBuff's K in the quickstart (a setting)",
    "20": "the 20-line example (lines of code)",
}


def pages(root: Path) -> list[Path]:
    """The pages whose blocks are generated: README.md, benchmarks/README.md, docs/benchmarks/*.md and
    any other page under docs/ that holds a block (e.g. docs/howto/tuning.md's cost table)."""
    fixed = [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs" / "benchmarks").glob("*.md"))]
    more = [p for p in sorted((root / "docs").rglob("*.md"))
            if p not in fixed and "<!-- report:" in p.read_text(errors="replace")]
    return fixed + more


def render(text: str, results: Path) -> tuple[str, list[str]]:
    """``text`` with every generated block rewritten from ``results``; and the names of the blocks
    whose content changed. An unknown block name raises ``KeyError`` naming it."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise KeyError(f"report: unknown block {name!r} (known: {', '.join(sorted(GENERATORS))})")
        new = GENERATORS[name](results).rstrip("\n") + "\n"
        if new != m.group(2):
            changed.append(name)
        return f"<!-- report:{name} -->\n{new}<!-- /report -->"

    return BLOCK.sub(one, text), changed


def prose(text: str) -> str:
    """README text outside generated blocks, fenced code, inline code, link targets, HTML
    comments and image lines: what a person typed."""
    text = BLOCK.sub("", text)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


NUMBER = re.compile(r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?(?![\w/])")


def unbacked_numbers(text: str) -> list[str]:
    """Numbers of the README's prose (see :func:`prose`) that are not in :data:`ALLOWED`."""
    out = []
    for lineno, line in enumerate(prose(text).splitlines(), 1):
        for m in NUMBER.finditer(line):
            num = m.group(0).rstrip(",.")
            if num not in ALLOWED:
                out.append(f"README.md: number {num!r} outside a generated block, backed by no result file: "
                           f"{line.strip()[:90]!r}")
    return out


#: docs/benchmarks pages whose tables list pages and files, not results: exempt from :func:`typed_tables`
NAV_PAGES = {"index.md"}

SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def typed_tables(text: str, page: str) -> list[str]:
    """Markdown table rows (a line starting with ``|`` after a header separator) outside generated
    blocks and fenced code: a table typed into a benchmark page, backed by no generator."""
    out: list[str] = []
    spans = [m.span() for m in BLOCK.finditer(text)] + [m.span() for m in re.finditer(r"^```.*?^```", text, re.S | re.M)]
    in_table, pos = False, 0
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        start, pos = pos, pos + len(line)
        if any(a <= start < b for a, b in spans):
            in_table = False
            continue
        row = line.strip()
        if SEPARATOR.match(row):
            in_table = True
        elif in_table and row.startswith("|"):
            out.append(f"{page}:{lineno}: a table row outside a generated block (typed numbers): {row[:80]!r}")
        else:
            in_table = False
    return out


def check(root: Path = ROOT, results: Path | None = None) -> list[str]:
    """Every problem ``--check`` reports (empty when the pages are what the files give)."""
    results = results or root / "benchmarks" / "results"
    problems = []
    for page in pages(root):
        if not page.is_file():
            continue
        text = page.read_text()
        _, changed = render(text, results)
        problems += [f"{page.relative_to(root)}: block {name!r} differs from what the result files give "
                     f"(run python benchmarks/report.py)" for name in changed]
        if page.name == "README.md" and page.parent == root:
            problems += unbacked_numbers(text)
        elif page.name not in NAV_PAGES:
            problems += typed_tables(text, str(page.relative_to(root)))
    return problems


def write(root: Path = ROOT, results: Path | None = None) -> list[str]:
    """Rewrite every page's blocks; the ``page: block`` names that changed."""
    results = results or root / "benchmarks" / "results"
    done = []
    for page in pages(root):
        if not page.is_file():
            continue
        text = page.read_text()
        new, changed = render(text, results)
        if new != text:
            page.write_text(new)
        done += [f"{page.relative_to(root)}: {name}" for name in changed]
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each stale block or number")
    p.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    a = p.parse_args(argv)
    try:
        problems = check(a.root) if a.check else write(a.root)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"report: a result file is missing: {e.filename}", file=sys.stderr)
        return 2
    if a.check:
        for line in problems:
            print(line)
        return 1 if problems else 0
    for line in problems:
        print(f"rewrote {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
