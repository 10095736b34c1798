"""report.html in a real browser: headless Chromium (Debian's package; .ci/run installs it) loads the page a
reviewer downloads from MLflow, and the verdict block and every figure must be there and drawn.

The page is built from the session's reproduced project exactly as publish builds it (no MLflow needed);
a copy of it gets a few lines of script that, once the page has loaded, write what the browser sees (the
verdict block's text, each figure's decoded size) into the DOM, which ``--dump-dom`` prints.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars"]

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
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("Chromium is not installed: .ci/run installs it with `apt-get install -y chromium`")
    pytest.skip("no Chromium here (CI installs it): `apt-get install -y chromium` to run the browser test")


class Browser:
    """Headless Chromium driven as a reviewer does, by clicks: the DevTools protocol over a pipe
    (``--remote-debugging-pipe``: Chromium reads fd 3 and writes fd 4), no driver or package to install."""

    def __init__(self, profile: Path, size: str = "1600,900") -> None:
        to_chrome, self._out = os.pipe()
        self._in, from_chrome = os.pipe()

        def fds() -> None:  # moved above 100 first, so that neither dup2 overwrites the other pipe's end
            high = [os.dup2(fd, 100 + i) for i, fd in enumerate((to_chrome, from_chrome))]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer, self._id = b"", 0
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call("Browser.close")
        except RuntimeError:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def call(self, method: str, session: str | None = None, **params):
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._in, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"{method}: Chromium closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def go(self, url: str) -> None:
        self.call("Page.navigate", self.session, url=url)

    def js(self, expression: str):
        """The value of a JavaScript expression in the page; None where it throws (a page still loading)."""
        wrapped = f"(() => {{ try {{ return {expression}; }} catch (e) {{ return null; }} }})()"
        return self.call("Runtime.evaluate", self.session, expression=wrapped, returnByValue=True)["result"].get("value")

    def wait(self, expression: str, timeout: float = 120.0):
        """The first true value of ``expression``, polled while the page loads and renders."""
        deadline = time.monotonic() + timeout
        while not (value := self.js(expression)):
            if time.monotonic() > deadline:
                text = self.js("document.body.innerText") or ""
                raise AssertionError(f"{expression} still false after {timeout:.0f} s; the page shows: {text[:1500]!r}")
            time.sleep(0.5)
        return value

    def click(self, selector: str, text: str) -> None:
        """Click the element matching ``selector`` whose text is ``text`` (once it is there)."""
        find = f"[...document.querySelectorAll({json.dumps(selector)})].find(e => e.textContent.trim() === {json.dumps(text)})"
        self.wait(f"!!{find}")
        self.js(f"{find}.click() || true")

    def click_until(self, selector: str, text: str, expression: str, tries: int = 4, timeout: float = 20.0):
        """Click as ``click`` does until ``expression`` holds: a single-page app can render a link before its
        router listens, or redraw the list under the click, and a reviewer then clicks again."""
        for attempt in range(tries):
            self.click(selector, text)
            try:
                return self.wait(expression, timeout)
            except AssertionError:
                if attempt == tries - 1:
                    raise

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", self.session, format="png")["data"]))


def browse(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    """Chromium on a file with a fresh profile, offline, giving scripts 5 s of virtual time to run."""
    args = [chromium(), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000", *extra, page.as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)


def build_report(repo: Path) -> str:
    """report.html as publish builds it, from the stage outputs of ``repo``."""
    code = (
        "import json, sys\n"
        "from pipeline import paths\n"
        "from pipeline.artifacts import variant\n"
        "from pipeline.files import read_json\n"
        "from pipeline.config import load_params\n"
        "from pipeline.present import page\n"
        "manifest = read_json(paths.REF_MANIFEST)\n"
        "reference = {k: manifest[k] for k in ('rule_sha256', 'run_key', 'env', 'cases')}\n"
        "variants = [variant.load(d) for d in load_params().trial.variants]\n"
        "sys.stdout.write(page.html(reference, variants, {v['variant']: v['plots'] for v in variants}))\n"
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
