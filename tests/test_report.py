"""benchmarks/report.py: every published benchmark number is generated from benchmarks/results/.

``report.py --check`` passes on the repository; a number changed in a generated block of a copy of
the README, a result typed into the README's prose, or a result file changed under the pages each
fail it, naming the block or the number; ``report.py`` (no flag) rewrites the blocks so that the
check passes again.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _report():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_report", BENCH / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def site(tmp_path):
    """A copy of the pages (README.md, docs/benchmarks/) and of the result files."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs" / "benchmarks", tmp_path / "docs" / "benchmarks")
    shutil.copytree(BENCH / "results", tmp_path / "benchmarks" / "results",
                    ignore=shutil.ignore_patterns("*.png"))
    return tmp_path


def test_check_passes_on_the_repository():
    r = subprocess.run([sys.executable, str(BENCH / "report.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_readme_holds_the_generated_blocks():
    text = (ROOT / "README.md").read_text()
    for name in ("quickstart-table", "readme-mnist-wallclock"):
        assert f"<!-- report:{name} -->" in text
    qs = (ROOT / "docs" / "benchmarks" / "quickstart.md").read_text()
    for name in ("quickstart-table", "wall-clock-table", "wall-clock-runs"):
        assert f"<!-- report:{name} -->" in qs


def test_a_changed_number_in_a_block_of_the_readme_fails(site):
    report = _report()
    assert report.check(site) == []
    readme = site / "README.md"
    text = readme.read_text()
    start = text.index("<!-- report:quickstart-table -->")
    row = text.index("| fedbuff |", start)
    m = re.compile(r"\d").search(text, row + len("| fedbuff |"))
    digit = text[m.start()]
    readme.write_text(text[:m.start()] + str((int(digit) + 1) % 10) + text[m.start() + 1:])
    problems = report.check(site)
    assert problems == ["README.md: block 'quickstart-table' differs from what the result files give "
                        "(run python benchmarks/report.py)"]


def test_a_result_typed_into_the_readme_prose_fails(site):
    report = _report()
    readme = site / "README.md"
    text = readme.read_text()
    readme.write_text(text.replace("## Documentation", "FedBuff is 7.3× faster than FedAvg.\n\n## Documentation"))
    problems = report.check(site)
    assert len(problems) == 1 and "number '7.3'" in problems[0], problems
    # the same number in a code block or in inline code is not prose
    readme.write_text(text.replace("## Documentation", "`server_lr: 7.3`\n\n```\n7.3\n```\n\n## Documentation"))
    assert report.check(site) == []


def test_a_changed_result_file_fails_and_report_rewrites_the_blocks(site):
    report = _report()
    path = site / "benchmarks" / "results" / "mnist_tuning.json"
    data = json.loads(path.read_text())
    row = next(r for r in data["report"] if r["strategy"] == "fedbuff")
    row["median_s"] += 10.0
    path.write_text(json.dumps(data))
    problems = report.check(site)
    assert "README.md: block 'readme-mnist-wallclock' differs from what the result files give " \
           "(run python benchmarks/report.py)" in problems
    assert "docs/benchmarks/mnist.md: block 'mnist-grid' differs from what the result files give " \
           "(run python benchmarks/report.py)" in problems
    assert len(problems) == 2, problems
    done = report.write(site)
    assert done == ["README.md: readme-mnist-wallclock", "docs/benchmarks/mnist.md: mnist-grid"]
    assert report.check(site) == []
    assert f"reaches 97 % test accuracy in {row['median_s']:,.1f} virtual s" in (site / "README.md").read_text()


def test_a_file_without_provenance_says_so_with_its_commit_date():
    import report_blocks

    line = report_blocks.made_by(BENCH / "results", "mnist-h1800.json")
    assert re.fullmatch(r"\(no provenance: made before \d{4}-\d\d-\d\d\)", line), line
    data = json.loads((BENCH / "results" / "quickstart_repro.json").read_text())
    line = report_blocks.made_by(BENCH / "results", "quickstart_repro.json")
    assert line.startswith(f"`{data['provenance']['command']}`, commit {data['provenance']['commit'][:7]}")


def test_an_unknown_block_is_one_line_and_changes_nothing(site):
    readme = site / "README.md"
    text = readme.read_text() + "\n<!-- report:no-such-block -->\n<!-- /report -->\n"
    readme.write_text(text)
    r = subprocess.run([sys.executable, str(BENCH / "report.py"), "--root", str(site)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "'no-such-block'" in r.stderr
    assert readme.read_text() == text


def test_a_table_typed_into_a_benchmark_page_fails(site):
    """A Markdown table row outside a generated block of docs/benchmarks/*.md fails --check, naming the
    page and the line; the same table inside fenced code does not."""
    report = _report()
    page = site / "docs" / "benchmarks" / "scale.md"
    text = page.read_text()
    lines = text.count("\n")
    page.write_text(text + "\n| run | updates |\n|---|---:|\n| fedbuff | 3,094 |\n")
    assert report.check(site) == [f"docs/benchmarks/scale.md:{lines + 4}: a table row outside a generated block "
                                  "(typed numbers): '| fedbuff | 3,094 |'"]
    page.write_text(text + "\n```\n| run | updates |\n|---|---:|\n| fedbuff | 3,094 |\n```\n")
    assert report.check(site) == []


def test_the_policy_pages_hold_their_generated_blocks():
    scale = (ROOT / "docs" / "benchmarks" / "scale.md").read_text()
    for name in ("scale-table", "scale-cnn-store", "scheduler-cost", "loop-overhead-table", "loop-cpu-table"):
        assert f"<!-- report:{name} -->" in scale
    sr = (ROOT / "docs" / "benchmarks" / "scheduling-robustness.md").read_text()
    for name in ("scheduling-table", "robustness-table"):
        assert f"<!-- report:{name} -->" in sr
    assert "old protocol" in sr.split("<!-- report:scheduling-table -->")[1].split("<!-- /report -->")[0]


def test_a_table_typed_into_the_benchmarks_readme_fails(site):
    """benchmarks/README.md is a generated page: its tables are blocks (--check passes on a copy of
    it), a table row typed outside a block fails --check naming the page and line, and a changed
    number inside one of its blocks fails too."""
    report = _report()
    page = site / "benchmarks" / "README.md"
    shutil.copy(BENCH / "README.md", page)
    text = page.read_text()
    assert report.check(site) == []
    lines = text.count("\n")
    page.write_text(text + "\n| variant | virtual s to 90 % |\n|---|---:|\n| fedbuff (server) | 26.0 |\n")
    assert report.check(site) == [f"benchmarks/README.md:{lines + 4}: a table row outside a generated block "
                                  "(typed numbers): '| fedbuff (server) | 26.0 |'"]
    page.write_text(text.replace("| **0.98** |", "| **0.99** |", 1))
    assert report.check(site) == ["benchmarks/README.md: block 'loop-overhead-table' differs from what the result "
                                  "files give (run python benchmarks/report.py)"]


def test_the_benchmarks_readme_holds_its_generated_blocks():
    text = (BENCH / "README.md").read_text()
    blocks = dict(re.findall(r"<!-- report:([\w-]+) -->\n(.*?)<!-- /report -->", text, re.S))
    for name in ("loop-overhead-table", "sqlite-blobs", "robust-calibration-table", "dp-overhead-table",
                 "privacy-utility-table", "serverless-compare", "kardam-cost"):
        assert name in blocks
        assert blocks[name].startswith("`") and ("provenance" in blocks[name] or "commit" in blocks[name])
    # privacy_utility.json shows a time to target and was made before the evaluation grid
    assert "old protocol" in blocks["privacy-utility-table"]
    assert "<!-- serverless:begin -->" not in text
