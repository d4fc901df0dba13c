"""What the binaries report: differences from target-only output, Pareto fronts, CSV and JSON."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from experiments import _paths


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two token lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    firsts = [first_difference(o, r) for o, r in zip(outputs, reference)]
    diverged = [f for f in firsts if f is not None]
    return {
        "divergence": len(diverged) / len(firsts) if firsts else 0.0,
        "diverged": len(diverged),
        "first_diff_per_request": firsts,
        "first_diff_median": float(np.median(diverged)) if diverged else None,
        "first_diff_min": int(min(diverged)) if diverged else None,
    }


def pareto(points_xy, minimize_x: bool = True) -> list[tuple[float, float]]:
    """The non-dominated points: y large and x small (or large), sorted along x."""
    pts = sorted(points_xy, key=lambda p: (p[0] if minimize_x else -p[0], -p[1]))
    front, best = [], float("-inf")
    for x, y in pts:
        if y > best:
            front.append((x, y))
            best = y
    return front


def write_csv(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> None:
    import csv

    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with _paths.atomic_open(path, "w", newline="", encoding="utf-8") as f:  # never half-written
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in keys})


def _cell(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, dict, tuple)):
        return json.dumps(v)
    return "" if v is None else v


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)
