"""The audits kept in experiments/results/ (compressed: X.jsonl.gz, audit.json.xz) still give the tables
committed beside them: every method's row of audit.md is recomputed from the compressed ledgers alone,
with no model (`_audit_books.report`, what `--report` prints), and compared cell by cell."""

from __future__ import annotations

import json
import lzma
import pathlib

import pytest

from experiments import _audit_books as B, _audit_tables as T

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results"
AUDITS = sorted(p.parent.name for p in RESULTS.glob("*/run.json"))


def _method_rows(markdown: str) -> list[str]:
    # the tables' rows, not their headers (whose wording changed since some runs); a speed cell left
    # blank by the audits of before "not timed" existed reads as that
    rows = [x for x in markdown.splitlines() if x.startswith("| ") and not x.startswith("| method")]
    return [x.replace("|  |", "| not timed |").replace("|  |", "| not timed |") for x in rows]


def test_the_committed_audits_are_compressed():
    assert len(AUDITS) >= 6
    for name in AUDITS:
        assert not list((RESULTS / name).glob("*.jsonl")) and not (RESULTS / name / "audit.json").exists(), name
        assert not (RESULTS / name / "audit.json.gz").exists(), name  # the older form, gzip: 5x larger
        assert (RESULTS / name / "completions.jsonl.gz").is_file() and (RESULTS / name / "audit.json.xz").is_file()


@pytest.mark.parametrize("name", AUDITS)
def test_a_committed_audit_table_regenerates_from_its_compressed_lines(name):
    out = RESULTS / name
    record = json.loads(lzma.decompress((out / "audit.json.xz").read_bytes()))
    table = B.report(out, "this machine")  # what --report prints: no model, nothing written
    assert _method_rows(table) == _method_rows((out / "audit.md").read_text())
    for part in record["parts"].values():  # every method of the record has its row
        assert [m["spec"] for m in part["methods"]] == \
            [x.split("|")[1].strip() for x in _method_rows(table)][:len(part["methods"])]


def test_results_stay_small():
    total = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert total < 5 * 2**20, f"experiments/results holds {total / 2**20:.1f} MiB; compress audits with --compress"


def test_the_pareto_plot_is_a_small_palette_png(tmp_path):
    from PIL import Image

    rows = {"target-only": {"speedup_vs_target_only": 1.0, "pass_at_1": 0.7},
            "exact": {"speedup_vs_target_only": 1.3, "pass_at_1": 0.7},
            "fly": {"speedup_vs_target_only": 2.0, "pass_at_1": 0.5}}
    T.plot_front(rows, tmp_path / "pareto.png")
    image = Image.open(tmp_path / "pareto.png")
    assert image.mode == "P" and image.size == (1080, 576)
    assert (tmp_path / "pareto.png").stat().st_size < 40_000
