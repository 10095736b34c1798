"""Screenshots for docs/outputs.md: report.html and the MLflow parent run, as a reviewer first sees them.

Usage, from a repository where `dvc repro` has run (Chromium installed: `apt-get install -y chromium`):

    python scripts/screenshots.py [--out docs]

Starts a real `mlflow server` on 127.0.0.1 with a temporary store, publishes this repository's results to it
(`python -m pipeline publish`), and takes headless-Chromium screenshots of: the report publish uploaded
(docs/report.png), the
parent run's page in model-training mode (docs/mlflow-parent-run.png), the experiment's runs table
(docs/mlflow-runs.png) and its Models tab, one LoggedModel per checkpoint (docs/mlflow-models.png). Nothing under
data/ is written.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _browser import Browser, find

PREFERENCES = {  # what a reviewer's browser remembers after their first visit: the model-training view, no assistant panel
    "mlflow.workflowType_v1": '"machine_learning"',
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
    "mlflow.assistant.panelOpen_v1": "false",
}


def shoot(page: Browser, url: str, out: Path, size: tuple[int, int], ready: str) -> None:
    """``url`` at ``size``, once ``ready`` (a JavaScript expression) holds and the page has settled."""
    page.resize(*size)
    page.go("about:blank")  # a full load: MLflow's hash routes would otherwise keep the last page's state
    page.go(url)
    page.wait(ready)
    time.sleep(3)  # figures and tables finish drawing after their data arrives
    page.screenshot(out)
    print(f"screenshots: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs", help="folder for the PNG files (default: docs)")
    args = parser.parse_args()
    repo, out = Path.cwd(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if find() is None:
        sys.exit("error: Chromium not found; install it (`apt-get install -y chromium`), then rerun")
    with tempfile.TemporaryDirectory(prefix="amp-shots-") as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        uri = f"http://127.0.0.1:{port}"
        mlflow = Path(sys.executable).parent / "mlflow"
        server = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db", "--artifacts-destination", f"{tmp}/artifacts"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(uri + "/health", timeout=2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        sys.exit("error: the mlflow server did not start")
                    time.sleep(0.5)
            env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(repo)}
            done = subprocess.run(
                [sys.executable, "-m", "pipeline", "publish"], env=env, capture_output=True, text=True, check=True
            )
            lines = done.stdout.strip().splitlines()
            run_page = next(w for w in lines[-2].split() if w.startswith(uri))
            runs_view = lines[-1].rsplit("review: ", 1)[1]
            # the page a reviewer downloads from the parent run: the very file publish uploaded
            report = next(Path(tmp, "artifacts").rglob("report.html"))
            with Browser(Path(tmp) / "profile") as page:
                shoot(page, report.as_uri(), out / "report.png", (1280, 1700), "document.readyState === 'complete'")
                page.go(f"{uri}/")
                page.wait("document.body.innerText.includes('Recent Experiments')")
                page.js(" && ".join(f"(localStorage.setItem({k!r}, {v!r}) || true)" for k, v in PREFERENCES.items()))
                shows = "document.body.innerText.includes({!r})".format
                shoot(page, run_page, out / "mlflow-parent-run.png", (1600, 1000), shows("Parameters"))
                shoot(page, runs_view, out / "mlflow-runs.png", (1600, 900), shows("matching runs"))
                shoot(page, runs_view.replace("/runs?", "/models?"), out / "mlflow-models.png", (1600, 700),
                      shows("reference float32"))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
