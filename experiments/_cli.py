"""Console side of the binaries: log lines on stderr, a ticker for long calls, the machine's description."""

from __future__ import annotations

import os
import platform
import sys
import threading
import time


def log(msg: str) -> None:
    print(f"[specjax] {msg}", file=sys.stderr, flush=True)


class Ticker:
    """Prints the elapsed time of a long call on stderr: a live line on a terminal,
    otherwise a line every `every` seconds (the generation is one compiled program,
    so there is nothing finer to report while it runs)."""

    def __init__(self, what: str, every: float = 30.0):
        self.what, self.every = what, every
        self._stop = threading.Event()
        self._tty = sys.stderr.isatty()

    def _run(self):
        start = time.perf_counter()
        period = 1.0 if self._tty else self.every
        while not self._stop.wait(period):
            elapsed = time.perf_counter() - start
            if self._tty:
                print(f"\r[specjax] {self.what} ... {elapsed:.0f}s", end="", file=sys.stderr, flush=True)
            else:
                log(f"{self.what} ... {elapsed:.0f}s")

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    return (f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on {len(jax.devices())} x "
            f"{dev.platform} ({kind})")


class Null:
    """A context manager that does nothing (no ticker)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
