"""Output files of the binaries: checked before any work, written whole, and an interrupt exits promptly.

    _paths.check_output("output", path)                 # a file to be written (--output, --csv, ...)
    _paths.check_output("output_dir", path, dir=True)   # a directory to be created or filled
    _paths.write_text(path, text)                       # atomic: the old file or the new one, never half
    _paths.run(main)                                    # app.run(main): one-line errors, a prompt exit on Ctrl-C
    _paths.set_status(lambda: "at step 40/400")         # what Ctrl-C reports besides the command to rerun
    raise _paths.RunError("...")                        # a run that cannot go on: one line, exit 1

Errors a user can act on (a bad flag, an output path that cannot be written, a damaged or
inconsistent input file: `specjax.models.LoadError` and the error types it subsumes, a run that
refuses to go on) end the process with one line on stderr, "error: ...", and status 1: no
traceback and no flag-help dump. Anything else is a bug and keeps its traceback.

Why `run`: a generation is one compiled XLA program. Ctrl-C raises
KeyboardInterrupt in the main thread at once, but the program keeps running on
XLA's threads, and the interpreter's exit (jax's teardown of its backend) waits
for it to finish: minutes for a long generation. `run` ends the process at the
KeyboardInterrupt with status 130 without that wait, after removing the
temporaries of unfinished atomic writes. For a main thread stuck in a C call
that never returns to Python, a helper thread watches SIGINT
(`signal.set_wakeup_fd`) and does the same after a second. Files written before
are complete; a file being written is absent (its previous version, if any, is
kept). A SIGINT that the parent set to be ignored (a background job of a
script) stays ignored.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import tempfile
import threading

from absl import app

_PENDING: set[str] = set()  # temporaries of atomic writes in progress (files or directories)
_STATUS = [None]  # a callable giving where the run stands, for the interrupt message
_GRACE_S = 1.0  # how long the main thread gets to raise KeyboardInterrupt itself


class RunError(Exception):
    """A run that cannot go on, for a reason its message gives in one line (a diverged training, a
    work directory made with other settings, too little data)."""


def set_status(status) -> None:
    """`status()` (a callable returning a line, or None) is printed when Ctrl-C ends the run: where it
    stands, what is saved. None: nothing beyond the command to run again."""
    _STATUS[0] = status


def rerun_command(width: int = 0) -> str:
    """The command line of this process, as a shell would take it back, the script named as the current
    directory reaches it (`python -m` gives its absolute path). With `width`, folded before flags into
    lines of about that many characters, continued with a backslash."""
    import shlex

    argv = list(sys.argv)
    if argv and os.path.isabs(argv[0]) and not os.path.relpath(argv[0]).startswith(".."):
        argv[0] = os.path.relpath(argv[0])
    if argv and argv[0].endswith(".py"):
        argv.insert(0, "python")
    lines = [""]
    for word in map(shlex.quote, argv):
        if width and word.startswith("--") and lines[-1] and len(lines[-1]) + 1 + len(word) > width:
            lines.append("   ")  # the continuation's indent, joined below with one more space
        lines[-1] = f"{lines[-1]} {word}" if lines[-1] else word
    return " \\\n".join(lines)


def check_output(flag: str, path, *, dir: bool = False) -> None:  # noqa: A002 (the flag's wording)
    """Raises app.UsageError naming --flag unless `path` can be written as a file (or created/filled as a
    directory with dir=True): not a directory where a file is needed or the reverse, not below a file,
    and its directory (or nearest existing ancestor) accepts a new file. None or "" is not checked."""
    if path is None or str(path) == "":
        return
    p = os.path.abspath(os.fspath(path))
    where = f"--{flag} {path}"
    if os.path.isdir(p) and not dir:
        raise app.UsageError(f"{where}: is a directory; a file path is needed")
    if os.path.lexists(p) and not os.path.isdir(p) and dir:
        raise app.UsageError(f"{where}: is a file; a directory is needed")
    probe = p if os.path.isdir(p) else os.path.dirname(p)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise app.UsageError(f"{where}: lies below {probe}, which is a file, not a directory")
    try:  # a real write (os.access says yes to root and knows nothing of read-only mounts)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise app.UsageError(f"{where}: cannot write in {probe}: {e.strerror or e}") from None


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", **kwargs):
    """open() for writing into a temporary beside `path` that replaces it only when the block completes.
    Missing parent directories are made: `check_output` accepts a path whose nearest existing
    ancestor is writable, so the write must be able to create the rest."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    _PENDING.add(tmp)
    # mkstemp makes the file 0600; the result gets the mode open() would have given it.
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
        os.replace(tmp, path)
    finally:
        _PENDING.discard(tmp)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_text(path, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _exit_interrupted() -> None:
    import shutil

    for tmp in list(_PENDING):
        with contextlib.suppress(OSError):
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                shutil.rmtree(tmp)
            else:
                os.unlink(tmp)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print("[specjax] interrupted: exiting now (files written before are complete; none is half-written)",
              file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        status = _STATUS[0]() if _STATUS[0] is not None else None
        if status:
            print(f"[specjax] {status}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        print(f"[specjax] to go on (or run it again): {rerun_command()}", file=sys.stderr, flush=True)
    os._exit(130)  # 128 + SIGINT, as a shell reports it; skips waiting for a running XLA program


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            threading.Timer(_GRACE_S, _exit_interrupted).start()


def exit_promptly_on_interrupt() -> None:
    """From the main thread: a SIGINT ends the process within about a second, even inside XLA."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(r,), daemon=True, name="specjax-sigint").start()


def one_line_errors() -> tuple[type, ...]:
    """The exception types that end a binary with one line: the user's to fix, not a bug."""
    types = [app.UsageError, RunError]
    try:
        from specjax import _files
        from specjax.models import config, convert, model, presets

        types += [_files.LoadError, convert.CheckpointError, convert.MissingTensorError, config.ConfigError,
                  presets.PresetError, model.CacheError]
    except (ImportError, AttributeError):  # pragma: no cover (a partial specjax: its own error will say so)
        pass
    return tuple(types)


def _one_line(e: BaseException) -> str:
    text = str(e)
    if isinstance(e, KeyError) and type(e).__str__ is KeyError.__str__ and len(e.args) == 1:
        text = str(e.args[0])  # a KeyError prints its message quoted
    return "error: " + (" ".join(text.split()) or type(e).__name__)


def run(main) -> None:
    """absl's app.run(main) with `exit_promptly_on_interrupt`, and one line (no traceback, no flag
    help) for the errors of `one_line_errors`."""

    @functools.wraps(main)
    def wrapped(argv):
        try:
            return main(argv)
        except KeyboardInterrupt:
            _exit_interrupted()
        except one_line_errors() as e:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            print(_one_line(e), file=sys.stderr, flush=True)
            sys.exit(getattr(e, "exitcode", 1) or 1)

    exit_promptly_on_interrupt()
    app.run(wrapped)
