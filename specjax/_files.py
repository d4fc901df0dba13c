"""Files that lose nothing: one error type for damaged inputs, atomic writes, checksum manifests.

- `LoadError(path, problem)`: the one error for a damaged or inconsistent input file; its
  message names the file and the problem (`models.LoadError` re-exports it).
- `atomic_write_bytes(path, data)` and `atomic_directory(dest)`: the result appears whole, by
  one rename, or not at all; an earlier file or directory at the destination is kept until the
  rename succeeded.
- `write_manifest(dir)` / `check_manifest(dir)`: SHA-256 and size of every file of a directory
  that specjax wrote, written last (a directory without it is incomplete), verified on reading
  back: a flipped bit on disk is caught, not only values out of range.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import threading

MANIFEST = "SHA256SUMS.json"
_FORMAT = "specjax-sha256-1"


class LoadError(ValueError):
    """A damaged or inconsistent input file: `str(e)` is "<path>: <problem>".

    `LoadError(message)` (one argument) is a problem found where the file is not known yet (a
    config field checked in memory); `models.load` adds the path before the error reaches a user.
    """

    def __init__(self, path, problem: str | None = None):
        if problem is None:
            path, problem = None, path
        self.path, self.problem = (None if path is None else str(path)), str(problem)
        super().__init__(str(self))

    def __str__(self):  # subclasses that are also KeyErrors must not print their message quoted
        return self.problem if self.path is None else f"{self.path}: {self.problem}"

    def with_path(self, path) -> "LoadError":
        """This error naming `path` (itself when it names a file already)."""
        if self.path is not None:
            return self
        e = type(self)(path, self.problem)
        e.__cause__ = self.__cause__
        return e

    def __reduce__(self):
        return type(self), ((self.problem,) if self.path is None else (self.path, self.problem))


def sha256_file(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(directory) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not every filesystem lets a directory be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def process_is_gone(pid: int) -> bool:
    """Whether no process has this PID: the writer of a temporary named after it was killed. A
    process we may not signal counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def atomic_write_bytes(path, data: bytes) -> None:
    """Writes `path` through a sibling temporary file, fsynced, then renamed over it: a reader
    sees the old bytes or the new ones, never a part; on failure the temporary is removed."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")  # per process and thread
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _listing(directory: pathlib.Path, name: str, exclude=()) -> list[pathlib.Path]:
    skip = {name, *exclude}
    return sorted(f for f in directory.rglob("*")
                  if f.is_file() and str(f.relative_to(directory)) not in skip)


def write_manifest(directory, *, name: str = MANIFEST, exclude=()) -> None:
    """Writes `directory/name`: {relative path: [sha256, size]} of every other file under it,
    atomically. Call it last: its presence marks the directory whole. `exclude`: relative paths
    that may change later (a log); they are recorded as such and `check_manifest` skips them."""
    directory = pathlib.Path(directory)
    files = {str(f.relative_to(directory)): [sha256_file(f), f.stat().st_size]
             for f in _listing(directory, name, exclude)}
    body = json.dumps({"format": _FORMAT, "files": files, "exclude": sorted(exclude)}, indent=0, sort_keys=True)
    atomic_write_bytes(directory / name, body.encode())


def check_manifest(directory, *, name: str = MANIFEST) -> None:
    """Raises `LoadError` naming the first file that is missing, changed (size or SHA-256) or not
    listed, or the manifest itself when it is missing or unreadable."""
    directory = pathlib.Path(directory)
    manifest = directory / name
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
        files = doc["files"]
        exclude = doc.get("exclude", [])
        if doc.get("format") != _FORMAT or not isinstance(files, dict) or not all(
                isinstance(v, list) and len(v) == 2 for v in files.values()) or not isinstance(exclude, list):
            raise TypeError
    except FileNotFoundError:
        raise LoadError(manifest, "missing (an incomplete write, or a directory specjax did not write)") from None
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
        raise LoadError(manifest, "not a valid checksum manifest (damaged)") from None
    for rel, (digest, size) in sorted(files.items()):
        f = directory / rel
        if not f.is_file():
            raise LoadError(f, f"missing (listed in {name})")
        got = f.stat().st_size
        if got != size:
            raise LoadError(f, f"has {got} bytes, {name} says {size}: truncated or altered")
        if sha256_file(f) != digest:
            raise LoadError(f, f"SHA-256 differs from {name}: the file is damaged or altered")
    listed = set(files)
    for f in _listing(directory, name, exclude):
        if str(f.relative_to(directory)) not in listed:
            raise LoadError(f, f"not listed in {name}: written by something else")


@contextlib.contextmanager
def atomic_directory(dest):
    """Yields a fresh sibling temporary directory to write into. On normal exit it replaces
    `dest` (an earlier `dest` is moved aside, and removed only once the rename succeeded); on an
    exception the temporary is removed and `dest` is left exactly as it was."""
    dest = pathlib.Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    old = dest.with_name(f".{dest.name}.old{os.getpid()}")
    for leftover in (tmp, old):
        _remove(leftover)
    tmp.mkdir()
    try:
        yield tmp
        if dest.exists():
            os.replace(dest, old)
            try:
                os.replace(tmp, dest)
            except BaseException:
                os.replace(old, dest)  # put the earlier one back
                raise
            _remove(old)
        else:
            os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    finally:
        _remove(tmp)


def _remove(path: pathlib.Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)
