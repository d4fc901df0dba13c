"""Console side of the binaries: log lines on stderr, a ticker for long calls, the machine's description."""

from __future__ import annotations

import functools
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


@functools.cache
def cpu() -> str:
    """The CPU's model name, cores and widest vector extension (AVX-512 or AVX2): what a timing on
    it depends on (a verify on the CPU is compute-bound, so the extension moves speed ratios)."""
    name, cpu_flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    cpu_flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in cpu_flags else "AVX2" if "avx2" in cpu_flags else "no AVX2"
    return f"{name} ({os.cpu_count()} cores, {isa})"


def machine() -> str:
    """cpu() and where jax runs: the line every benchmark and result record names its machine with."""
    import jax

    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    return f"{cpu()}; jax {jax.__version__} on {len(jax.devices())} x {dev.platform} ({kind})"


class Null:
    """A context manager that does nothing (no ticker)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
