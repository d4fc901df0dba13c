"""The audit's tables (experiments/_audit_tables.py) from hand-made ledgers: which exact run a
speedup over exact is read against."""

from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/ is not an installed package
from experiments import _audit_run as R, _audit_tables as T  # noqa: E402

SPECS = ["target-only", "exact", "fly", "exact:k=25", "fly:k=25", "fly:k=8", "fly:draft=pld", "fly:theta=1,k=25"]


def test_exact_peer_matches_k_and_draft():
    peer = {s: T.exact_peer(s, SPECS) for s in SPECS}
    assert peer["fly:k=25"] == "exact:k=25" and peer["fly:theta=1,k=25"] == "exact:k=25"
    assert peer["fly"] == peer["exact"] == peer["target-only"] == "exact"
    assert peer["fly:k=8"] == "exact" and peer["fly:draft=pld"] == "exact"  # no exact of their own: the plain one
    assert T.exact_peer("fly:k=25", ["target-only", "fly:k=25"]) is None


def test_speedup_over_exact_is_read_against_its_peer():
    specs = ["target-only", "exact", "fly", "exact:k=25", "fly:k=25"]
    part = R.Part("humaneval", "HumanEval", [R.Task("HumanEval/0", [])], 16)
    seconds = {"target-only": 4.0, "exact": 2.0, "fly": 1.0, "exact:k=25": 8.0, "fly:k=25": 4.0}  # 8 tokens each
    books = {"completions": {("HumanEval/0", s): dict(first_diff=None, tau=2.0, loose=0, tokens=[1] * 8, passed=True)
                             for s in specs},
             "speed": {("humaneval", "HumanEval/0", s): dict(tokens=8, seconds=seconds[s]) for s in specs},
             "batches": types.SimpleNamespace(lines={})}
    methods = [types.SimpleNamespace(spec=s) for s in specs]
    rows = T.summarize(part, methods, books, wanted_speed=1, seed=0)
    assert rows["fly"]["speedup_vs_exact"] == 2.0 and rows["fly"]["speedup_vs_target_only"] == 4.0
    assert rows["fly:k=25"]["speedup_vs_exact"] == 2.0 and rows["fly:k=25"]["exact_peer"] == "exact:k=25"
    assert rows["exact:k=25"]["speedup_vs_exact"] == 1.0
    table = T.markdown([part], {"humaneval": rows}, 0.0, dict(model="m", draft="d", k=15, batch_size=1,
                                                               prompt_bucket=64, matmul="q8"), "here")
    quality = table.split("Cost")[0]  # the quality-and-speed table; its last column is vs exact
    cells = {r.split("|")[1].strip(): r.split("|")[-2].strip() for r in quality.splitlines() if r.startswith("| ")}
    assert cells["fly"] == "2.00" and cells["fly:k=25"] == "2.00 (vs exact:k=25)"


def _two_prompt_books(specs, seconds, cpus):
    """Two prompts, 8 tokens per method each; prompt i's rows name cpus[i] (None: the field absent)."""
    ids = ["HumanEval/0", "HumanEval/1"]
    speed = {}
    for i, (task, cpu) in enumerate(zip(ids, cpus)):
        for s in specs:
            speed[("humaneval", task, s)] = dict(tokens=8, seconds=seconds[i][s], **({"cpu": cpu} if cpu else {}))
    books = {"completions": {(t, s): dict(first_diff=None, tau=2.0, loose=0, tokens=[1] * 8, passed=True)
                             for t in ids for s in specs},
             "speed": speed, "batches": types.SimpleNamespace(lines={})}
    part = R.Part("humaneval", "HumanEval", [R.Task(t, []) for t in ids], 16)
    return part, books


def _table(part, rows):
    return T.markdown([part], {"humaneval": rows}, 0.0, dict(model="m", draft="d", k=15, batch_size=1,
                                                              prompt_bucket=64, matmul="q8"), "here")


def test_a_run_timed_on_two_cpus_gives_each_ones_speedups_beside_the_pooled():
    specs = ["target-only", "exact", "fly"]
    # the AVX-512 machine verifies cheaply (exact 2x target-only); the AVX2 one does not (1.25x)
    seconds = [{"target-only": 4.0, "exact": 2.0, "fly": 1.0}, {"target-only": 5.0, "exact": 4.0, "fly": 4.0}]
    part, books = _two_prompt_books(specs, seconds, ["Xeon (2 cores, AVX-512)", "EPYC (2 cores, AVX2)"])
    rows = T.summarize(part, [types.SimpleNamespace(spec=s) for s in specs], books, wanted_speed=2, seed=0)
    assert rows["exact"]["speedup_vs_target_only"] == 9.0 / 6.0  # pooled: 16 tokens in 9 s against 6 s
    by_cpu = rows["exact"]["speed_by_cpu"]
    assert list(by_cpu) == ["Xeon (2 cores, AVX-512)", "EPYC (2 cores, AVX2)"]
    assert by_cpu["Xeon (2 cores, AVX-512)"]["speedup_vs_target_only"] == 2.0
    assert by_cpu["EPYC (2 cores, AVX2)"]["speedup_vs_target_only"] == 1.25
    assert rows["fly"]["speed_by_cpu"]["Xeon (2 cores, AVX-512)"]["speedup_vs_exact"] == 2.0
    assert rows["fly"]["speed_by_cpu"]["EPYC (2 cores, AVX2)"]["speedup_vs_exact"] == 1.0
    table = _table(part, rows)
    assert "Timed on: Xeon (2 cores, AVX-512) (1 prompt), EPYC (2 cores, AVX2) (1 prompt)." in table
    assert "| fly | 4.00, 2.00 | 1.25, 1.00 |" in table


def test_timings_that_name_no_cpu_leave_the_table_as_it_was_and_are_counted_apart():
    specs = ["target-only", "exact"]
    seconds = [{"target-only": 4.0, "exact": 2.0}] * 2
    part, books = _two_prompt_books(specs, seconds, [None, None])  # ledgers written before the field
    rows = T.summarize(part, [types.SimpleNamespace(spec=s) for s in specs], books, wanted_speed=2, seed=0)
    assert "speed_by_cpu" not in rows["exact"] and "Timed on" not in _table(part, rows)
    part, books = _two_prompt_books(specs, seconds, [None, "EPYC (2 cores, AVX2)"])  # resumed after it
    rows = T.summarize(part, [types.SimpleNamespace(spec=s) for s in specs], books, wanted_speed=2, seed=0)
    assert rows["exact"]["speed_by_cpu"][T.UNRECORDED]["prompts"] == 1
    assert f"Timed on: {T.UNRECORDED} (1 prompt), EPYC (2 cores, AVX2) (1 prompt)." in _table(part, rows)
