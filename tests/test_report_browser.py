"""report.html in a real browser: headless Chromium (Debian's `chromium`, installed by scripts/setup.sh) shows the
verdict on the first screen and loads every plot.

The page is measured by a short script added to a copy of it beside the original (so its plots resolve as they
do for a reader): on load it writes what it measured into the document's title, which --dump-dom prints. No
browser driver is needed. Where Chromium is missing the test skips, except in CI (HYBRIDRL_REQUIRE_SLURM=1), where
set-up installs it and a missing browser is a failure.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from slurm_cluster import required
from test_report import write_run

from hybridrl.report import aggregate_main, report_main

VIEWPORT = (1280, 900)  # a laptop's first screen
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

if CHROMIUM is None and required():
    pytest.fail("HYBRIDRL_REQUIRE_SLURM=1 (CI) but no chromium: scripts/setup.sh installs it (apt-get, as root)",
                pytrace=False)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: `apt-get install chromium` (as root), "
                                                         "which scripts/setup.sh does where it can")

# base64, so that the title's text survives --dump-dom's escaping untouched
PROBE = """<script>
window.addEventListener("load", () => {
  const box = (el) => { if (!el) return null; const r = el.getBoundingClientRect(); return [r.top, r.bottom]; };
  const verdict = document.getElementById("verdict");
  document.title = "probe:" + btoa(JSON.stringify({
    viewport: [window.innerWidth, window.innerHeight],
    verdict: box(verdict),
    sentence: box(verdict && verdict.querySelector("li")),
    images: Array.from(document.images, (i) => [i.getAttribute("src"), i.complete, i.naturalWidth]),
  }));
});
</script>
"""


def measure(html: Path) -> dict[str, Any]:
    """What the probe saw of `html` in a 1280 x 900 window."""
    probe = html.with_name(f"probe-{html.name}")
    probe.write_text(html.read_text().replace("</body>", PROBE + "</body>"))
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         f"--user-data-dir={html.parent / '.chromium'}", f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
         "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120)
    found = re.search(r"<title>probe:([A-Za-z0-9+/=]+)</title>", out.stdout)
    assert found, f"chromium printed no measurement (rc {out.returncode}): {out.stderr[-2000:]}"
    return json.loads(base64.b64decode(found[1]))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """report.html of a small placement-only study, its plots in a folder beside it."""
    results = tmp_path_factory.mktemp("browser") / "results"
    runs = [write_run(results, "vllm-split-aaaa1111", "vllm", "split", speed=1.0, seed=1),
            write_run(results, "vllm-restart-bbbb2222", "vllm", "restart", speed=0.5, seed=2)]
    aggregate_main(runs, results / "steps.csv", results / "steps.parquet")
    report_main(results / "steps.parquet", results / "report.md", results / "report.html", results / "plots",
                "Browser study")
    return results / "report.html"


def test_the_verdict_is_on_the_first_screen_and_every_plot_loads(report: Path) -> None:
    seen = measure(report)
    # the window's own frame takes some of its height, as a desktop browser's does: the first screen is what is left
    width, height = seen["viewport"]
    assert width == VIEWPORT[0] and 0.75 * VIEWPORT[1] < height <= VIEWPORT[1]
    assert seen["verdict"] and seen["sentence"], "report.html has no verdict section with a sentence"
    top, bottom = seen["verdict"]
    assert 0 <= top and bottom <= height, f"the verdict spans {top:.0f}-{bottom:.0f} px of a {height} px first screen"
    plots = sorted(p.name for p in (report.parent / "plots").glob("*.png"))
    assert sorted(Path(src).name for src, _, _ in seen["images"]) == plots and len(plots) >= 5
    broken = [src for src, complete, width in seen["images"] if not (complete and width > 0)]
    assert not broken, f"images that did not load: {broken}"


def test_the_probe_sees_an_image_that_does_not_load(report: Path, tmp_path: Path) -> None:
    """The check above can fail: a plot missing from beside the page reads as not loaded."""
    copy = tmp_path / "report.html"
    shutil.copy(report, copy)
    (tmp_path / "plots").mkdir()
    for png in sorted((report.parent / "plots").glob("*.png"))[1:]:
        shutil.copy(png, tmp_path / "plots" / png.name)
    seen = measure(copy)
    assert [width for _, _, width in seen["images"]].count(0) == 1
