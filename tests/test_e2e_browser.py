"""report.html in a real browser: headless Chromium (Debian's package; .ci/run installs it) loads the page a
reviewer downloads from MLflow, and the verdict block and every figure must be there and drawn.

The page is built from the session's reproduced project exactly as publish builds it (no MLflow needed);
a copy of it gets a few lines of script that, once the page has loaded, write what the browser sees (the
verdict block's text, each figure's decoded size) into the DOM, which ``--dump-dom`` prints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import _browser
import pytest
from _browser import FLAGS

pytestmark = pytest.mark.integration

PROBE = """<script>
window.addEventListener("load", () => {
  const figures = [...document.querySelectorAll("figure[data-plot]")].map(f => {
    const img = f.querySelector("img");
    return {plot: f.dataset.plot, width: img.naturalWidth, height: img.naturalHeight, complete: img.complete};
  });
  const verdict = document.querySelector("#verdict");
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify({figures, verdict: verdict ? verdict.innerText : null,
                                      first: document.body.children[1] ? document.body.children[1].id : null});
  document.body.appendChild(probe);
});
</script>"""


def chromium() -> str:
    path = _browser.find()
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail("Chromium is not installed: .ci/run installs it with `apt-get install -y chromium`")
    pytest.skip("no Chromium here (CI installs it): `apt-get install -y chromium` to run the browser test")


def Browser(profile: Path, size: str = "1600,900") -> _browser.Browser:  # noqa: N802 (used as the class it returns)
    """scripts/_browser.Browser on this machine's Chromium, skipped or failed as ``chromium`` says where there is none."""
    return _browser.Browser(profile, size, chromium())


def browse(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    """Chromium on a file with a fresh profile, offline, giving scripts 5 s of virtual time to run."""
    args = [chromium(), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000", *extra, page.as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)


def build_report(repo: Path) -> str:
    """report.html as publish builds it, from the stage outputs of ``repo``."""
    code = (
        "import sys\n"
        "from pipeline.artifacts import reference, variant\n"
        "from pipeline.config import load_params\n"
        "from pipeline.present import page\n"
        "variants = [variant.load(d) for d in load_params().trial.variants]\n"
        "sys.stdout.write(page.html(reference.read_manifest(), variants))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.run([os.sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout


def test_report_renders_in_chromium_with_the_verdict_first_and_every_figure(reproduced, tmp_path):
    page = build_report(reproduced)
    dtypes = json.loads(subprocess.run(
        [os.sys.executable, "-c",
         "import json; from pipeline.config import load_params; print(json.dumps(load_params().trial.variants))"],
        cwd=reproduced, env={**os.environ, "PYTHONPATH": str(reproduced)}, capture_output=True, text=True, check=True,
    ).stdout)
    probed = tmp_path / "report-probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    dom = browse(probed, tmp_path / "profile", "--dump-dom").stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    seen = json.loads(found.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    assert seen["first"] == "verdict", "the verdict block is not the first thing under the title"
    for d in dtypes:
        decision = json.loads((reproduced / f"data/decision/{d}/decision.json").read_text())["decision"]
        assert f"{d}: {decision.upper()}" in seen["verdict"], seen["verdict"]
    plots = {f["plot"]: f for f in seen["figures"]}
    assert set(plots) == {f"{d}/{n}" for d in dtypes for n in ("loss", "scale", "envelope", "errors")}
    for name, f in plots.items():
        assert f["complete"] and f["width"] >= 400 and f["height"] >= 300, (name, f)  # decoded, not a broken image
    # A screenshot, as a reviewer sees the top of the page: a real PNG of the requested size.
    shot = tmp_path / "report.png"
    page_file = tmp_path / "report.html"
    page_file.write_text(page)
    browse(page_file, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1280,1600")
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and int.from_bytes(data[16:20], "big") == 1280
    if os.environ.get("AMP_SCREENSHOTS"):  # scripts/screenshots.sh: refresh docs/ for the README
        shutil.copy(shot, Path(os.environ["AMP_SCREENSHOTS"]) / "report.png")
