"""Screenshots for the README: report.html and the MLflow parent run, as a reviewer first sees them.

Usage, from a repository where `dvc repro` has run (Chromium installed: `apt-get install -y chromium`):

    python scripts/screenshots.py [--out docs]

Starts a real `mlflow server` on 127.0.0.1 with a temporary store, publishes this repository's results to it
(`python -m pipeline publish`), and takes headless-Chromium screenshots of: the report (docs/report.png), the
parent run's page in model-training mode (docs/mlflow-parent-run.png), the experiment's runs table
(docs/mlflow-runs.png) and its Models tab, one LoggedModel per checkpoint (docs/mlflow-models.png). Nothing under
data/ is written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def shoot(url: str, out: Path, size: str, wait_ms: int) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        sys.exit("error: Chromium not found; install it (`apt-get install -y chromium`), then rerun")
    with tempfile.TemporaryDirectory(prefix="amp-chromium-") as profile:
        subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
                        f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url],
                       capture_output=True, timeout=180, check=True)
    print(f"screenshots: {out}")


def report_html(repo: Path) -> str:
    sys.path.insert(0, str(repo))
    from pipeline import paths
    from pipeline.present import page
    from pipeline.files import read_json
    from pipeline.artifacts import variant
    from pipeline.config import load_params

    dtypes = load_params().trial.variants
    manifest = read_json(paths.REF_MANIFEST)
    reference = {k: manifest[k] for k in ("rule_sha256", "run_key", "env", "cases")}
    variants = [variant.load(d) for d in dtypes]
    return page.html(reference, variants, {v["dtype"]: v["plots"] for v in variants})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs", help="folder for the PNG files (default: docs)")
    args = parser.parse_args()
    repo, out = Path.cwd(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="amp-shots-") as tmp:
        doc = Path(tmp) / "report.html"
        doc.write_text(report_html(repo))
        shoot(doc.as_uri(), out / "report.png", "1280,1700", 3000)
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
            shoot(run_page, out / "mlflow-parent-run.png", "1600,1000", 20000)
            shoot(runs_view, out / "mlflow-runs.png", "1600,900", 20000)
            shoot(runs_view.replace("/runs?", "/models?"), out / "mlflow-models.png", "1600,700", 20000)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
