"""Wall seconds per phase of a stage, printed on its last line for scripts/timings.py (the cost of a verdict)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Iterator


class Phases:
    """Wall seconds per phase of freeze: stdout only, never a DVC output, since timings differ run to run. What
    ``stream`` times inside the write counts under its own name, not under ``writing``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.streamed = 0.0

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def stream(self, name: str, chunks: Iterable[dict]) -> Iterator[dict]:
        """``chunks`` passed on, the time spent producing each counted as ``name``."""
        it = iter(chunks)
        while True:
            t0 = time.perf_counter()
            with self(name):
                chunk = next(it, None)
            self.streamed += time.perf_counter() - t0
            if chunk is None:
                return
            yield chunk

    def line(self) -> str:
        own = dict(self.seconds, writing=self.seconds.get("writing", 0.0) - self.streamed)
        return "freeze seconds: " + ", ".join(f"{name} {s:.2f}" for name, s in own.items())
