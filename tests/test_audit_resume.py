"""experiments/audit.py killed mid-run and rerun gives the uninterrupted run's files.

Subprocesses on `random:tiny` (experiments/_models.py) with K = 2, 6 tokens per answer,
2 MT-Bench questions and 4 HumanEval problems (every one fails with a random model, which
is fine here), batch 2, one prompt bucket; the runs share a JAX compilation cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import _jsonl as J

ROOT = Path(__file__).resolve().parents[1]
AUDIT = ROOT / "experiments" / "audit.py"
ARGS = ["--model", "random:tiny", "--k", "2", "--draft", "self:1", "--method", "exact", "--method", "csd",
        "--mtbench_questions", "2", "--mtbench_max_new_tokens", "6", "--humaneval_problems", "4",
        "--humaneval_max_new_tokens", "6", "--batch_size", "2", "--prompt_bucket", "1024", "--noself_check"]
METHODS = ("target-only", "exact", "csd")
TASKS = [f"MT-Bench/{i}" for i in range(2)] + [f"HumanEval/{i}" for i in range(4)]
KEYS = ["task_id", "method", "reply", "completion", "passed", "tokens", "tau", "loose", "differs_from_target",
        "first_diff"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, not the 8 fake ones of conftest.py
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1")
    return env


def audit(out_dir, env, *extra):
    return subprocess.Popen([sys.executable, str(AUDIT), *ARGS, *extra, "--output_dir", str(out_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def finish(proc, ok=True):
    out, err = proc.communicate(timeout=300)
    if ok:
        assert proc.returncode == 0, f"audit failed:\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


def lines(path):  # each line's checksum verified and dropped
    return [J.unseal(x, f"{path}:{n}")[0] for n, x in enumerate(path.read_text().splitlines(), 1)]


def by_key(rows, *names):
    keys = [tuple(r[n] for n in names) for r in rows]
    assert len(set(keys)) == len(keys), "a (task, method) appears twice"
    return dict(zip(keys, rows))


@pytest.fixture(scope="module")
def whole(env, tmp_path_factory):
    """An uninterrupted run (it also fills the compilation cache, so later runs keep a steady pace)."""
    out = tmp_path_factory.mktemp("whole")
    finish(audit(out, env))
    return out


def test_a_killed_audit_resumes_to_the_uninterrupted_result(env, whole, tmp_path):
    resumed = tmp_path / "resumed"
    want = lines(whole / "completions.jsonl")
    assert all(list(r) == KEYS for r in want)
    assert {(r["task_id"], r["method"]) for r in want} == {(t, m) for t in TASKS for m in METHODS}
    assert all(r["passed"] is False and r["completion"] is not None for r in want if r["task_id"][0] == "H")
    assert all(r["passed"] is None and r["completion"] is None for r in want if r["task_id"][0] == "M")
    assert all(r["first_diff"] is None for r in want if r["method"] in ("target-only", "exact"))

    proc = audit(resumed, env)
    path, deadline = resumed / "completions.jsonl", time.monotonic() + 240
    while not (path.exists() and path.read_bytes().count(b"\n") >= 4):
        assert proc.poll() is None, "the audit ended before it could be killed"
        assert time.monotonic() < deadline, "no completions were written"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    partial = path.read_bytes()
    written = partial.count(b"\n")
    assert 4 <= written < len(want), f"{written} lines: the kill came too late to test anything"
    path.write_bytes(partial + b'{"task_id": "HumanEval/3", "method": "cs')  # as if a write were cut off too

    out, err = finish(audit(resumed, env))
    assert f"{written}/{len(want)} completions already in" in err
    assert "ended in a cut-off line" in err
    got = lines(path)
    assert len(got) == len(want)  # nothing duplicated, nothing lost
    assert by_key(got, "task_id", "method") == by_key(want, "task_id", "method")
    assert got[:written] == [J.unseal(x, "partial")[0] for x in partial.splitlines()]  # what was there stayed as it was
    assert by_key(lines(resumed / "mtbench_logprob.jsonl"), "task_id", "method") == \
        by_key(lines(whole / "mtbench_logprob.jsonl"), "task_id", "method")
    assert "| csd |" in (resumed / "audit.md").read_text()

    out, err = finish(audit(resumed, env))  # a finished run decodes nothing again
    assert f"{len(want)}/{len(want)} completions already in" in err and " batch 1/" not in err
    assert lines(path) == got

    settings = json.loads((resumed / "run.json").read_text())
    assert settings.pop("matmul") == "auto" and settings.pop("adaptive") is True and settings.pop("_crc32")
    # as recorded before --matmul, --adaptive (and checksums) existed: those runs verified K every round
    (resumed / "run.json").write_text(json.dumps(settings))
    out, err = finish(audit(resumed, env, "--batch_size", "3", "--matmul", "q8"), ok=False)  # other settings
    assert ("other settings (--batch_size 2 -> 3; --matmul 'auto' -> 'q8'; --adaptive False -> True)" in err
            and "Traceback" not in err)


def test_a_run_copies_what_an_earlier_run_with_the_same_settings_decoded(env, whole, tmp_path):
    part, grown = tmp_path / "part", tmp_path / "grown"
    finish(audit(part, env, "--humaneval_problems", "2"))  # MT-Bench and the first HumanEval batch
    first = by_key(lines(part / "completions.jsonl"), "task_id", "method")
    assert len(first) == 4 * len(METHODS)

    out, err = finish(audit(grown, env, "--reuse_from", str(part)))
    assert f"copied {len(first)} completions from {part}" in err
    assert "HumanEval batch 1/" not in err and "HumanEval batch 2/2" in err  # only the new batch decoded
    got = by_key(lines(grown / "completions.jsonl"), "task_id", "method")
    assert got == by_key(lines(whole / "completions.jsonl"), "task_id", "method")
    assert set(by_key(lines(grown / "reused.jsonl"), "task_id", "method")) == set(first)
    verdicts = by_key(lines(grown / "humaneval_results.jsonl"), "task_id", "method")
    assert set(verdicts) == {k for k in got if k[0][0] == "H"}
    assert by_key(lines(grown / "mtbench_logprob.jsonl"), "task_id", "method") == \
        by_key(lines(part / "mtbench_logprob.jsonl"), "task_id", "method")  # copied, not scored again
    times = by_key(lines(grown / "batches.jsonl"), "part", "batch", "method")
    assert {k: v for k, v in times.items() if k[:2] != ("humaneval", 1)} == \
        by_key(lines(part / "batches.jsonl"), "part", "batch", "method")
    assert f"{len(first)} of the {len(got)} completions" in (grown / "audit.md").read_text()

    out, err = finish(audit(tmp_path / "other", env, "--reuse_from", str(part), "--k", "3"), ok=False)
    assert "recorded with other settings (--k 2 -> 3)" in err and "Traceback" not in err
    out, err = finish(audit(tmp_path / "bad", env, "--reuse_from", str(tmp_path / "none")), ok=False)
    assert "not an audit output directory" in err


def test_at_batch_one_the_quality_pass_is_the_interleaved_timing(env, tmp_path):
    out_dir = tmp_path / "b1"
    finish(audit(out_dir, env, "--batch_size", "1", "--humaneval_problems", "0"))
    timed = by_key(lines(out_dir / "speed.jsonl"), "part", "task_id", "method")
    batches = by_key(lines(out_dir / "batches.jsonl"), "part", "batch", "method")
    assert set(timed) == {("mtbench", t, m) for t in TASKS[:2] for m in METHODS}
    for (part, task, method), r in timed.items():
        b = batches[(part, int(task.split("/")[1]), method)]
        assert (r["seconds"], r["tokens"]) == (b["generate_seconds"], b["tokens"])
    table = (out_dir / "audit.md").read_text()
    assert "speed over the first 2 at batch 1" in table
    from experiments import _cli
    assert {r["cpu"] for r in timed.values()} == {_cli.cpu()}  # a resumed run on another CPU is read apart
    assert f"Timed on: {_cli.cpu()} (2 prompts)." in table
    row = next(x for x in table.splitlines() if x.startswith("| exact |"))
    assert float(row.split("|")[-3]) > 0  # a speedup against target-only is reported

    # timing rows lost after the fact (their writes failed on a full disk, say): the next sitting times
    # those prompts again for the missing method; with no time left to do so, the table says "not timed"
    speed_path = out_dir / "speed.jsonl"
    kept = [x for x in speed_path.read_text().splitlines() if '"method": "csd"' not in x]
    assert len(kept) == len(timed) - 2
    speed_path.write_text("\n".join(kept) + "\n")
    out, err = finish(audit(out_dir, env, "--batch_size", "1", "--humaneval_problems", "0",
                            "--time_budget_minutes", "0.000001"))
    assert "time budget reached: stopped timing MT-Bench before prompt 1" in err
    table = (out_dir / "audit.md").read_text()
    for method in METHODS:  # every method's speed cells: none is timed on every prompt by every method
        row = next(x for x in table.splitlines() if x.startswith(f"| {method} |")).split("|")
        assert row[-3].strip() == row[-2].strip() == "not timed", row
    out, err = finish(audit(out_dir, env, "--batch_size", "1", "--humaneval_problems", "0"))
    assert "MT-Bench/0 lacks the timing of csd: timed again now" in err
    again = by_key(lines(speed_path), "part", "task_id", "method")
    assert set(again) == set(timed) and {k: again[k] for k in timed if k[2] != "csd"} == \
        {k: v for k, v in timed.items() if k[2] != "csd"}
    table = (out_dir / "audit.md").read_text()
    row = next(x for x in table.splitlines() if x.startswith("| exact |"))
    assert float(row.split("|")[-3]) > 0 and "not timed" not in table


def _tables(out_dir):
    """audit.md below its head (the sitting's command, whose --output_dir differs, and its wall time) and
    audit.csv."""
    return (out_dir / "audit.md").read_text().split("\nAudit:", 1)[1].split("\n", 1)[1], \
        (out_dir / "audit.csv").read_text()


def test_a_compressed_audit_keeps_its_lines_and_tables_and_resumes(env, whole, tmp_path):
    import gzip
    import lzma
    import shutil

    packed = tmp_path / "packed"
    shutil.copytree(whole, packed)
    names = sorted(p.name for p in whole.glob("*.jsonl"))
    assert {"completions.jsonl", "batches.jsonl", "humaneval_results.jsonl"} <= set(names)
    proc = subprocess.run([sys.executable, str(AUDIT), "--output_dir", str(packed), "--compress"], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(packed.glob("*.jsonl")) and not (packed / "audit.json").exists()
    for name in names:  # byte for byte
        assert gzip.decompress((packed / f"{name}.gz").read_bytes()) == (whole / name).read_bytes()
    assert json.loads(lzma.decompress((packed / "audit.json.xz").read_bytes())) == \
        json.loads((whole / "audit.json").read_text())
    assert not (packed / "audit.json.gz").exists()

    out, err = finish(audit(packed, env))  # a rerun reads the compressed lines: nothing to decode
    assert "18/18 completions already in" in err and " batch 1/" not in err
    assert _tables(packed) == _tables(whole)
    assert not (packed / "audit.json").exists()  # a compressed run writes its record compressed
    assert json.loads(lzma.decompress((packed / "audit.json.xz").read_bytes()))["summary"] == \
        json.loads((whole / "audit.json").read_text())["summary"]

    # a compressed part of a run resumes: HumanEval's second batch taken out of every file, as if the
    # run had been compressed before it; new lines go to plain files beside the .gz, and compressing
    # again folds them in
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(whole / "run.json", part)
    late = ("HumanEval/2", "HumanEval/3")
    for name in names:
        rows = [x for x in (whole / name).read_text().splitlines(keepends=True)
                if not any(f'"{t}"' in x for t in late) and '"part": "humaneval", "batch": 1,' not in x]
        (part / name).write_text("".join(rows))
        J.compress(part / name)
    out, err = finish(audit(part, env))
    assert "12/18 completions already in" in err and "HumanEval batch 2/2" in err and "HumanEval batch 1/" not in err
    assert (part / "completions.jsonl").exists() and (part / "completions.jsonl.gz").exists()
    for name in names:
        J.compress(part / name)
    got = [J.unseal(x, "gz")[0] for x in gzip.decompress((part / "completions.jsonl.gz").read_bytes()).splitlines()]
    assert by_key(got, "task_id", "method") == by_key(lines(whole / "completions.jsonl"), "task_id", "method")
    assert not list(part.glob("*.jsonl"))


def test_an_older_gzip_record_becomes_xz_with_the_same_json(tmp_path):
    """Runs compressed before the record was xz kept audit.json.gz: --compress (and a rerun's write)
    turns it into audit.json.xz holding the same JSON, and leaves no second form beside it."""
    import gzip
    import lzma

    from experiments import _audit_books as B

    record = {"summary": {"exact": {"humaneval_pass": 0.5}}, "parts": {"humaneval": {"tasks": 2, "methods": [
        {"spec": s, "records": [{"task_id": f"HumanEval/{i}", "reply": "x = 1\n" * 50} for i in range(2)]}
        for s in ("target-only", "exact")]}}}
    text = json.dumps(record, indent=1)
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "completions.jsonl.gz").write_bytes(gzip.compress(b""))  # a compressed run
    (tmp_path / "audit.json.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "tables.sha256").write_text("0  audit.json.gz\n")
    assert "audit.json.gz" in B.compress_run(tmp_path)
    assert not (tmp_path / "audit.json.gz").exists() and not (tmp_path / "audit.json").exists()
    assert json.loads(lzma.decompress((tmp_path / "audit.json.xz").read_bytes())) == record
    assert B.read_record(tmp_path) == record
    assert "audit.json.xz" in (tmp_path / "tables.sha256").read_text()
    assert subprocess.run(["sha256sum", "-c", "--quiet", "--ignore-missing", "tables.sha256"],
                          cwd=tmp_path).returncode == 0
    first = (tmp_path / "audit.json.xz").read_bytes()
    assert B.compress_run(tmp_path) == []  # nothing left to fold
    (tmp_path / "audit.json.gz").write_bytes(gzip.compress(b"{}"))  # a stale older form beside it
    assert B.write_record(tmp_path, text).name == "audit.json.xz"
    assert not (tmp_path / "audit.json.gz").exists() and (tmp_path / "audit.json.xz").read_bytes() == first

    plain = tmp_path / "plain"  # an uncompressed run writes audit.json and drops a compressed leftover
    plain.mkdir()
    (plain / "audit.json.xz").write_bytes(first)
    assert B.write_record(plain, text).name == "audit.json"
    assert not (plain / "audit.json.xz").exists() and B.read_record(plain) == record


def test_report_prints_a_runs_tables_from_its_ledgers_and_writes_nothing(env, whole, tmp_path):
    """--report: the tables as the ledgers stand, for a finished run (its audit.md's rows) and for one
    still running (fewer rows done); no model loads and no file changes."""
    import shutil

    def report(out_dir):
        proc = subprocess.run([sys.executable, str(AUDIT), "--output_dir", str(out_dir), "--report"], env=env,
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        return proc.returncode, proc.stdout, proc.stderr

    def rows(text):
        return [x for x in text.splitlines() if x.startswith("| ") and not x.startswith("| method")]

    def files(d):
        return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in d.iterdir()}

    running = tmp_path / "running"
    shutil.copytree(whole, running)
    before = files(running)
    code, out, err = report(running)
    assert code == 0, err[-3000:]
    assert files(running) == before and "loaded" not in err  # nothing written, no model
    table = (whole / "audit.md").read_text()
    assert rows(out) == rows(table[table.index("\nAudit:"):])  # every row, cost tables included
    assert "read from its ledgers" in out and "this sitting" not in out

    # a run in flight: HumanEval/3's answers not written yet by every method
    path = running / "completions.jsonl"
    path.write_text("".join(x for x in path.read_text().splitlines(keepends=True)
                            if not ('"HumanEval/3"' in x and '"csd"' in x)))
    code, out, err = report(running)
    assert code == 0, err[-3000:]
    assert "HumanEval: 3 of 4 prompts finished by every method" in out
    assert "MT-Bench: 2 of 2 prompts finished by every method" in out

    code, out, err = report(tmp_path / "nothing")
    assert code != 0 and "--report" in err and "not an audit output directory (no run.json there)" in err
