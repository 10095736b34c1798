"""Headless Chromium for the tests and scripts/screenshots.py: Debian's package (`apt-get install -y chromium`),
driven over the DevTools protocol on a pipe, so that no driver or package is needed."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def find() -> str | None:
    """The Chromium on PATH, or None."""
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Browser:
    """Headless Chromium driven as a reviewer does, by clicks: the DevTools protocol over a pipe
    (``--remote-debugging-pipe``: Chromium reads fd 3 and writes fd 4), no driver or package to install."""

    def __init__(self, profile: Path, size: str = "1600,900", browser: str | None = None) -> None:
        to_chrome, self._out = os.pipe()
        self._in, from_chrome = os.pipe()

        def fds() -> None:  # moved above 100 first, so that neither dup2 overwrites the other pipe's end
            high = [os.dup2(fd, 100 + i) for i, fd in enumerate((to_chrome, from_chrome))]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen(
            [browser or find() or "chromium", *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
             "--remote-debugging-pipe", "about:blank"],
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

    def resize(self, width: int, height: int) -> None:
        """The page's viewport, as a window of that size shows it."""
        self.call("Emulation.setDeviceMetricsOverride", self.session, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
