"""Append-only JSON-lines files that survive a kill: each line is written whole, flushed and
fsynced; on reading, a truncated last line (a write cut off) is dropped from the file.

A finished run's files may be compressed (`compress`: X.jsonl -> X.jsonl.gz, which keeps them small in
git). A ledger reads X.jsonl.gz first and X.jsonl after it, and appends to X.jsonl: a compressed run
resumes, and compressing it again folds the new lines into the .gz.

Each line carries a CRC-32 of its own content as its last field, "_crc32" (`seal`), verified when the
line is read back (`unseal`): a bit flipped on disk in a line is an error naming the file and the line,
not a value silently used. Appends stay one write each. Lines written before checksums existed (the
committed audits in experiments/results) have none and are read as they are, but once a file has shown
a checksummed line every later line must carry one. A .gz part is checked by gzip's own CRC."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import zlib
from typing import Callable, Hashable

from specjax._files import LoadError

CHECK = "_crc32"  # the field holding a line's checksum; a ledger's readers never see it


def _crc(text: str) -> str:
    return f"{zlib.crc32(text.encode('utf-8')):08x}"


def seal(line: dict) -> str:
    """The text of one ledger line (no newline): `line` as JSON with its checksum as the last field."""
    text = json.dumps(line)
    if CHECK in line or not text.endswith("}"):
        raise ValueError(f"a ledger line is a JSON object without a {CHECK!r} field: {text[:80]}")
    return f'{text[:-1]}{", " if line else ""}"{CHECK}": "{_crc(text)}"}}'


def unseal(raw: bytes | str, where: str) -> tuple[dict, bool]:
    """(the line without its checksum, whether it had one); LoadError naming `where` (file:line) when the
    line is not JSON or its content no longer matches its checksum. The checksum is over the line's
    JSON as `seal` wrote it, so a flip anywhere in the line (the checksum's digits included) is caught."""
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(where, f"not a JSON line ({e}); the file was damaged or changed by something other "
                               "than the audit") from None
    if not isinstance(line, dict):
        raise LoadError(where, "not a JSON object; the file was damaged or changed by something other than the audit")
    if CHECK not in line:
        return line, False
    want = line.pop(CHECK)
    if want != _crc(json.dumps(line)):
        raise LoadError(where, "its checksum does not match its content: the line was damaged on disk (or "
                               "edited); delete that line and rerun to decode it again")
    return line, True


def packed(path: str | os.PathLike) -> pathlib.Path:
    """The compressed twin of a JSON-lines path: X.jsonl -> X.jsonl.gz."""
    path = pathlib.Path(path)
    return path.with_name(path.name + ".gz")


def exists(path: str | os.PathLike) -> bool:
    """Whether a ledger has lines at `path`, plain or compressed."""
    return pathlib.Path(path).is_file() or packed(path).is_file()


def read_bytes(path: str | os.PathLike) -> bytes:
    """The lines of a ledger, compressed part first (what a `Ledger` reads, cut-off tail included)."""
    path, gz = pathlib.Path(path), packed(path)
    data = _gunzip(gz) if gz.is_file() else b""
    return data + (path.read_bytes() if path.is_file() else b"")


def _gunzip(gz: pathlib.Path) -> bytes:
    try:
        return gzip.decompress(gz.read_bytes())
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a CRC mismatch too
        raise LoadError(gz, f"not a whole gzip file (damaged or truncated): {e}") from None


def compress(path: str | os.PathLike) -> bool:
    """Folds X.jsonl (and an earlier X.jsonl.gz) into X.jsonl.gz and removes X.jsonl; False when there is
    nothing to fold. Refuses a file that ends in a cut-off line (resume the run first). The gzip header
    holds no time stamp, so compressing the same lines twice gives the same bytes."""
    path, gz = pathlib.Path(path), packed(path)
    if not path.is_file():
        return False
    data = read_bytes(path)
    if data and not data.endswith(b"\n"):
        raise ValueError(f"{path} ends in a cut-off line: rerun the audit to finish it before compressing")
    tmp = gz.with_name(gz.name + ".tmp")
    tmp.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    os.replace(tmp, gz)
    path.unlink()
    return True


class Ledger:
    """Lines of one JSON-lines file (and its compressed part), keyed by `key(line)`; `append` writes and
    records one.

    A key seen twice in the file is an error (the file was edited or concatenated), since
    a rerun then could not tell which line holds."""

    def __init__(self, path: str | os.PathLike, key: Callable[[dict], Hashable], *, unique: bool = True,
                 read_only: bool = False):
        self.path, self.key = pathlib.Path(path), key
        self.lines: dict[Hashable, dict] = {}
        self.dropped_tail = b""
        self._sealed = False  # a checksummed line was read: every later one must carry one
        gz = packed(self.path)
        if gz.exists():  # written whole by `compress`: no cut-off tail to look for
            self._read(_gunzip(gz), gz, unique)
        if self.path.exists():
            data = self.path.read_bytes()
            end = data.rfind(b"\n") + 1  # everything after the last newline is a cut-off write
            if end < len(data):
                self.dropped_tail = data[end:]
            if end < len(data) and not read_only:  # read_only: another run's file, left as it is
                with open(self.path, "r+b") as f:
                    f.truncate(end)
                    f.flush()
                    os.fsync(f.fileno())
            self._read(data[:end], self.path, unique)
        self._file = None

    def _read(self, data: bytes, where: pathlib.Path, unique: bool) -> None:
        for number, raw in enumerate(data.splitlines(), 1):
            if not raw.strip():
                continue
            line, sealed = unseal(raw, f"{where}:{number}")
            if self._sealed and not sealed:
                raise LoadError(f"{where}:{number}", f"no {CHECK} field after lines that have one: the line "
                                                     "was damaged on disk (or edited); delete it and rerun")
            self._sealed = self._sealed or sealed
            try:
                k = self.key(line)
            except (KeyError, TypeError):
                raise LoadError(f"{where}:{number}", "lacks the fields of this ledger's lines") from None
            if unique and k in self.lines:
                raise LoadError(f"{where}:{number}", f"{k} appears twice")
            self.lines[k] = line

    def __contains__(self, k) -> bool:
        return k in self.lines

    def __len__(self) -> int:
        return len(self.lines)

    def get(self, k, default=None):
        return self.lines.get(k, default)

    def append(self, line: dict) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(seal(line) + "\n")  # one write: a kill leaves a whole line or a cut-off tail
        self._file.flush()
        os.fsync(self._file.fileno())
        self.lines[self.key(line)] = line

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
