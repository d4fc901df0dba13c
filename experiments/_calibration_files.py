"""Calibration files: a CSD memory directory (orbax memory + calibration.json) and ASD's JSON."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np
from absl import app

from specjax import verify

from experiments import _paths


def save_csd_memory(path: str | os.PathLike, pairs_P2: np.ndarray, counts_P: np.ndarray, capacity: int,
                    metadata: dict[str, Any]) -> pathlib.Path:
    """Saves the memory of (pairs, counts, capacity) under path/memory (`verify.save_csd_memory`)
    and the calibration's description in path/calibration.json."""
    path = pathlib.Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    verify.save_csd_memory(path / "memory", verify.csd_memory(capacity, np.asarray(pairs_P2, np.int32).reshape(-1, 2),
                                                              np.asarray(counts_P, np.int32)), overwrite=True)
    _paths.write_text(path / "calibration.json", json.dumps(metadata, indent=1))
    return path


def load_csd_memory(path: str | os.PathLike, vocab_size: int | None = None,
                    capacity: int | None = None) -> verify.CSDMemory:
    """The CSD memory saved by `save_csd_memory` (`--csd_memory`), as a verify.CSDMemory.

    capacity: None keeps the saved capacity. Token ids past vocab_size are an error.
    """
    path = pathlib.Path(path).resolve()
    if not (path / "memory").is_dir():
        raise app.UsageError(f"--csd_memory {path}: no saved memory there (expected {path}/memory, "
                             "written by experiments/calibrate_csd.py)")
    try:
        return verify.load_csd_memory(path / "memory", capacity, vocab_size)
    except ValueError as e:
        raise app.UsageError(f"--csd_memory {path}: {e}") from None


def load_asd_calibration(path: str | os.PathLike) -> dict[str, Any]:
    try:
        cal = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise app.UsageError(f"--asd_calibration {path}: {e}") from None
    missing = {"budget", "gate", "block_cap", "suffix", "k"} - set(cal)
    if missing:
        raise app.UsageError(f"--asd_calibration {path}: missing {', '.join(sorted(missing))}")
    return cal
