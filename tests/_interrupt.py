"""Ctrl-C for the binaries' tests: a child with SIGINT at its default, interrupted at a known point."""

import signal
import subprocess


def interruptible():
    """In the child before exec: SIGINT at its default. A shell starts background jobs with SIGINT
    ignored and children inherit that (the suite run as `pytest ... &`), and a program that finds
    SIGINT ignored rightly keeps ignoring it: that is the shell's intent, not the test's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_when(proc: subprocess.Popen, marker: str, timeout: float = 60) -> str:
    """Reads the child's stderr until `marker` appears, sends SIGINT, and returns the rest of its
    stderr once it exits (killed on the way out if it has not)."""
    err = ""
    try:
        while marker not in err:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, err[-3000:]
            err += line
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rest
