"""The audit's statistics (experiments/_audit_stats.py) against hand-computed values, and its
append-only JSON-lines files (experiments/_jsonl.py) against cut-off and edited files."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/ is not an installed package
from experiments import _audit_stats as S  # noqa: E402
from experiments import _jsonl as J  # noqa: E402


# Wilson by hand, z = 1.96: 8/10: center (0.8 + z^2/20) / (1 + z^2/10) = 0.71681,
# half z sqrt(0.016 + z^2/400) / 1.38415 = 0.22657; 0/5: both 0.38415 / 1.76830 = 0.21724;
# 1/2: center 0.5, half 1.96 * sqrt(0.125 + z^2/16) / 2.92073 = 0.40547.
@pytest.mark.parametrize("k,n,lo,hi", [(8, 10, 0.49016, 0.94332), (0, 5, 0.0, 0.43448), (5, 5, 0.56552, 1.0),
                                       (1, 2, 0.09453, 0.90547)])
def test_wilson_interval_by_hand(k, n, lo, hi):
    got = S.wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-5)


def test_wilson_rejects_bad_counts_and_is_nan_without_trials():
    assert all(math.isnan(x) for x in S.wilson(0, 0))
    with pytest.raises(ValueError, match="successes"):
        S.wilson(6, 5)


def _pairs(wins, losses, both=0, neither=0):
    method = [1] * wins + [0] * losses + [1] * both + [0] * neither
    reference = [0] * wins + [1] * losses + [1] * both + [0] * neither
    return method, reference


# exact McNemar: 1 win / 6 losses -> 2 (C(7,0) + C(7,1)) / 2^7 = 0.125; 0 / 5 -> 2 / 32;
# 3 / 3 -> 2 * 42 / 64 > 1 -> 1; concordant pairs do not count.
@pytest.mark.parametrize("wins,losses,p", [(1, 6, 0.125), (6, 1, 0.125), (0, 5, 0.0625), (3, 3, 1.0),
                                           (0, 0, 1.0), (0, 10, 2 / 1024)])
def test_mcnemar_exact_by_hand(wins, losses, p):
    method, reference = _pairs(wins, losses, both=7, neither=4)
    assert S.mcnemar_exact(method, reference) == (pytest.approx(p), wins, losses)


def test_recovery_point_and_bootstrap_interval():
    same = [1, 0, 1, 1, 0, 1]
    assert S.recovery(same, same) == (1.0, 1.0, 1.0)  # every resample has ratio 1
    # a = [1, 1, 0], b = [1, 1, 1]: a resample's ratio is (draws of problems 0 and 1) / 3,
    # Binomial(3, 2/3) / 3: P[0] = 1/27 = 0.037 > 0.025 and P[1] = 8/27 > 0.025, so the
    # 95% percentile interval is [0, 1] around 2/3.
    point, lo, hi = S.recovery([1, 1, 0], [1, 1, 1])
    assert (point, lo, hi) == (pytest.approx(2 / 3), 0.0, 1.0)
    # a method that also passes problems the reference fails can exceed 1
    m, r = _pairs(wins=4, losses=0, both=16, neither=20)
    point, lo, hi = S.recovery(m, r, seed=3)
    assert point == pytest.approx(20 / 16) and 1.0 <= lo < point < hi
    assert S.recovery(m, r, seed=3) == (point, lo, hi)  # seeded
    assert all(math.isnan(x) for x in S.recovery([1, 0], [0, 0]))  # reference passes nothing
    with pytest.raises(ValueError, match="one length"):
        S.recovery([1, 0], [1, 0, 1])


def test_recovery_interval_matches_the_exact_bootstrap_distribution():
    # n = 4 problems: all 4^4 = 256 resamples enumerated give the exact bootstrap quantiles
    a, b = np.array([1, 0, 1, 1]), np.array([1, 1, 1, 0])
    grid = np.stack(np.meshgrid(*[range(4)] * 4, indexing="ij"), -1).reshape(-1, 4)
    den = b[grid].sum(1)
    exact = np.sort(a[grid].sum(1)[den > 0] / den[den > 0])
    _, lo, hi = S.recovery(a, b, n_boot=40000, seed=1)
    # the sampled quantiles fall on the exact distribution's values near 2.5% / 97.5%
    assert np.quantile(exact, 0.02) <= lo <= np.quantile(exact, 0.03)
    assert np.quantile(exact, 0.97) <= hi <= np.quantile(exact, 0.98)


def test_divergence_and_median_first_difference():
    d = S.divergence([None, 3, 5, None])
    assert d == {"divergence": 0.5, "diverged": 2, "n": 4, "first_diff_median": 4.0, "first_diff_min": 3}
    assert S.divergence([None, None])["first_diff_median"] is None


def test_mean_and_paired_difference_intervals():
    assert S.mean_interval([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    mean, lo, hi = S.mean_interval([1.0, 2.0, 3.0, 4.0], seed=0)
    assert mean == 2.5 and 1.0 <= lo < 2.5 < hi <= 4.0
    # a constant shift: every resample's paired difference is exactly -0.5
    assert S.paired_difference([0.5, 1.5, 2.5], [1.0, 2.0, 3.0]) == (-0.5, -0.5, -0.5)


def test_ledger_drops_a_cut_off_last_line_and_refuses_edited_files(tmp_path):
    path = tmp_path / "x.jsonl"
    book = J.Ledger(path, lambda r: r["id"])
    book.append({"id": 1, "v": "a"})
    book.append({"id": 2, "v": "b"})
    book.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"id": 3, "v"')  # a write cut off by a kill
    other = J.Ledger(path, lambda r: r["id"], read_only=True)  # another run's file, read by --reuse_from
    assert sorted(other.lines) == [1, 2] and path.read_bytes() == whole + b'{"id": 3, "v"'
    again = J.Ledger(path, lambda r: r["id"])
    assert sorted(again.lines) == [1, 2] and again.dropped_tail == b'{"id": 3, "v"'
    assert path.read_bytes() == whole  # the tail is gone from the file too
    again.append({"id": 3, "v": "c"})
    again.close()
    assert [r["id"] for r in map(__import__("json").loads, path.read_text().splitlines())] == [1, 2, 3]
    path.write_bytes(whole + whole)
    with pytest.raises(ValueError, match="appears twice"):
        J.Ledger(path, lambda r: r["id"])
    assert len(J.Ledger(path, lambda r: r["id"], unique=False)) == 2  # unless later lines may replace earlier
    path.write_bytes(b'{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not a JSON line"):
        J.Ledger(path, lambda r: r["id"])


def test_ledger_reads_its_compressed_part_and_appends_beside_it(tmp_path):
    import gzip

    path = tmp_path / "x.jsonl"
    book = J.Ledger(path, lambda r: r["id"])
    for i in (1, 2):
        book.append({"id": i})
    book.close()
    whole = path.read_bytes()
    assert J.compress(path) and not path.exists() and J.exists(path)
    assert gzip.decompress(J.packed(path).read_bytes()) == whole
    packed_once = J.packed(path).read_bytes()
    book = J.Ledger(path, lambda r: r["id"])  # resumed: the compressed lines, then new plain ones
    assert sorted(book.lines) == [1, 2]
    book.append({"id": 3})
    book.close()
    three = J.seal({"id": 3}).encode() + b"\n"  # the line and its checksum
    assert path.read_bytes() == three and J.read_bytes(path) == whole + three
    assert sorted(J.Ledger(path, lambda r: r["id"]).lines) == [1, 2, 3]
    path.write_bytes(J.seal({"id": 2}).encode() + b"\n")  # a key in both parts
    with pytest.raises(ValueError, match=r"x.jsonl:1: 2 appears twice"):
        J.Ledger(path, lambda r: r["id"])
    path.write_bytes(b'{"id": 3}\n{"id": 4')  # a cut-off tail: finish the run before compressing
    with pytest.raises(ValueError, match="cut-off line"):
        J.compress(path)
    path.write_bytes(b'{"id": 3}\n')
    assert J.compress(path) and not J.compress(path)  # folded in; then nothing left to fold
    assert gzip.decompress(J.packed(path).read_bytes()) == whole + b'{"id": 3}\n'
    again = tmp_path / "y.jsonl"
    again.write_bytes(whole)
    J.compress(again)
    assert J.packed(again).read_bytes() == packed_once  # no time stamp: the same lines, the same bytes
