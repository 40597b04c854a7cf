"""benchmarks/report_blocks_mnist.py: the MNIST and deployment pages hold no typed table.

Every table of docs/benchmarks/mnist.md and deployment.md sits in a generated block; a result
file changed under one of them fails ``report.py --check`` naming the block, and ``report.py``
writes the file's figure into the page (and the goal's verdict follows the file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_report import _report, site  # noqa: F401 (the copy of the pages and result files: one fixture)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
PAGES = ("mnist.md", "deployment.md")
BLOCK = re.compile(r"<!-- report:[\w-]+ -->\n.*?<!-- /report -->", re.S)


@pytest.mark.parametrize("page", PAGES)
def test_every_table_row_of_the_page_is_generated(page):
    text = BLOCK.sub("", (ROOT / "docs" / "benchmarks" / page).read_text())
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    typed = [line for line in text.splitlines() if line.startswith("|")]
    assert typed == [], f"{page}: typed table rows {typed[:3]}"


def _edit(site: Path, name: str, run: str, key: str, value):
    path = site / "benchmarks" / "results" / name
    data = json.loads(path.read_text())
    next(r for r in data["rows"] if r["run"] == run)[key] = value
    path.write_text(json.dumps(data))


def test_a_changed_dpcnn_run_fails_the_check_and_is_written_into_the_page(site):
    report = _report()
    _edit(site, "mnist-dp-dpcnn.json", "fedbuff_dp8_dpcnn_after_dp_fixes_1", "final_accuracy_full_test", 0.9)
    problems = report.check(site)
    assert set(problems) == {f"docs/benchmarks/mnist.md: block {b!r} differs from what the result files give "
                             "(run python benchmarks/report.py)" for b in ("mnist-dpcnn-steps", "mnist-goals")}, problems
    report.write(site)
    assert report.check(site) == []
    page = (site / "docs" / "benchmarks" / "mnist.md").read_text()
    assert "| 0.948 | - | 0.9000 | 0.948 |" in page
    # FedBuff without DP 99.04 %: this run is now 9.04 points behind, the six runs' mean 4.51: missed
    assert "3.35, 9.04, 3.80, 3.48 points behind" in page
    assert "**missed on average** (94.53 %, 4.51 behind), in 5 of 6 runs" in page


def test_the_deployment_goal_follows_the_ten_node_file(site):
    report = _report()
    path = site / "benchmarks" / "results" / "deploy_latency_10nodes_idle.json"
    data = json.loads(path.read_text())
    data["failed_or_timeout_tasks"] = 2
    path.write_text(json.dumps(data))
    assert report.check(site) == ["docs/benchmarks/deployment.md: block 'deployment-goals' differs from what the "
                                  "result files give (run python benchmarks/report.py)"]
    report.write(site)
    page = (site / "docs" / "benchmarks" / "deployment.md").read_text()
    assert "(40 of 40 updates, 2 failed tasks): **not met**" in page
