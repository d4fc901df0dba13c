"""Append-only JSON-lines files that survive a kill: each line is written whole, flushed and
fsynced; on reading, a truncated last line (a write cut off) is dropped from the file."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Callable, Hashable


class Ledger:
    """Lines of one JSON-lines file, keyed by `key(line)`; `append` writes and records one.

    A key seen twice in the file is an error (the file was edited or concatenated), since
    a rerun then could not tell which line holds."""

    def __init__(self, path: str | os.PathLike, key: Callable[[dict], Hashable], *, unique: bool = True,
                 read_only: bool = False):
        self.path, self.key = pathlib.Path(path), key
        self.lines: dict[Hashable, dict] = {}
        self.dropped_tail = b""
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
            for number, raw in enumerate(data[:end].splitlines(), 1):
                if not raw.strip():
                    continue
                try:
                    line = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.path}:{number}: not a JSON line ({e}); the file was changed "
                                     "by something other than the audit") from None
                k = key(line)
                if unique and k in self.lines:
                    raise ValueError(f"{self.path}:{number}: {k} appears twice")
                self.lines[k] = line
        self._file = None

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
        self._file.write(json.dumps(line) + "\n")  # one write: a kill leaves a whole line or a cut-off tail
        self._file.flush()
        os.fsync(self._file.fileno())
        self.lines[self.key(line)] = line

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
