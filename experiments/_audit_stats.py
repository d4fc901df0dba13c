"""The audit's statistics: pass@1 with a Wilson interval, recovery with a paired bootstrap
interval over problems, an exact McNemar test against the reference, divergence and the
median first differing token, and means with bootstrap intervals (the MT-Bench proxy).

Pure NumPy and the standard library; every random step takes a seed, so a table is
reproducible from its completions.jsonl.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ((nan, nan) for n = 0).

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n
    successes, which is where pass@1 of a strong model sits."""
    if n == 0:
        return float("nan"), float("nan")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p, z2 = successes / n, z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def _paired(a: Sequence, b: Sequence) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired samples must be two flat arrays of one length, got {a.shape} and {b.shape}")
    return a, b


def recovery(passed: Sequence[bool], reference: Sequence[bool], *, n_boot: int = 10000, seed: int = 0,
             level: float = 0.95) -> tuple[float, float, float]:
    """pass@1(method) / pass@1(reference) on the same problems, and a paired percentile
    bootstrap interval: problems are resampled with replacement, both methods' results
    moving together (resamples in which the reference passes nothing are left out).
    (nan, nan, nan) when the reference passes nothing."""
    a, b = _paired(passed, reference)
    if b.sum() == 0:
        return float("nan"), float("nan"), float("nan")
    point = a.sum() / b.sum()
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n_boot, len(a)))
    num, den = a[idx].sum(axis=1), b[idx].sum(axis=1)
    ratios = num[den > 0] / den[den > 0]
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(point), float(lo), float(hi)


def mcnemar_exact(passed: Sequence[bool], reference: Sequence[bool]) -> tuple[float, int, int]:
    """Exact (binomial) McNemar test of paired pass/fail results: (two-sided p, wins, losses).

    wins: problems the method passes and the reference fails; losses: the reverse. Under
    the null hypothesis each discordant problem is a fair coin, so p = min(1, 2 P[X <= min])
    with X ~ Binomial(wins + losses, 1/2); p = 1 without discordant problems."""
    a, b = _paired(passed, reference)
    wins, losses = int(np.sum((a > 0) & (b == 0))), int(np.sum((a == 0) & (b > 0)))
    n = wins + losses
    if n == 0:
        return 1.0, wins, losses
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail), wins, losses


def divergence(first_diffs: Sequence[int | None]) -> dict:
    """Share of outputs that differ from the reference's (None: identical), and the median
    and minimum first differing token over those that differ."""
    diverged = [f for f in first_diffs if f is not None]
    return {"divergence": len(diverged) / len(first_diffs) if len(first_diffs) else float("nan"),
            "diverged": len(diverged), "n": len(first_diffs),
            "first_diff_median": float(np.median(diverged)) if diverged else None,
            "first_diff_min": int(min(diverged)) if diverged else None}


def mean_interval(values: Sequence[float], *, n_boot: int = 10000, seed: int = 0,
                  level: float = 0.95) -> tuple[float, float, float]:
    """Mean and a percentile bootstrap interval of it."""
    x = np.asarray(values, np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    means = x[np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(x.mean()), float(lo), float(hi)


def paired_difference(values: Sequence[float], reference: Sequence[float], **kw) -> tuple[float, float, float]:
    """Mean of values - reference over the same items, with a bootstrap interval (pairs resampled)."""
    a, b = _paired(values, reference)
    return mean_interval(a - b, **kw)
