"""The audit's own files carry checksums verified when it reads them back: every ledger line (its
"_crc32" field), run.json, and gzip's CRC for the compressed parts; the tables it only writes are
listed in tables.sha256. A flipped bit is one line naming the file (and the line), never used silently.
Lines written before checksums existed are still read (tests/test_audit_results.py: the committed runs).
The binary's test also covers Ctrl-C: exit 130, how much is saved and the command that goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import _audit_books as B, _jsonl as J
from specjax._files import LoadError
from _interrupt import interrupt_when, interruptible

ROOT = Path(__file__).resolve().parents[1]


def _ledger(path, n=3):
    book = J.Ledger(path, lambda r: r["id"])
    for i in range(n):
        book.append({"id": i, "tokens": [i, 7, 300], "tau": 1.5 + i, "reply": f"answer {i}\n\u00e9"})
    book.close()
    return path.read_bytes()


def test_every_single_bit_flip_in_a_ledger_line_is_caught_and_named_with_its_line(tmp_path):
    path = tmp_path / "completions.jsonl"
    whole = _ledger(path)
    first, second = whole.index(b"\n") + 1, whole.index(b"\n", whole.index(b"\n") + 1)
    want = J.Ledger(path, lambda r: r["id"]).lines
    assert sorted(want) == [0, 1, 2] and all(J.CHECK not in line for line in want.values())
    for pos in range(first, second + 1):  # every byte of the second line and its newline
        for bit in range(8):
            bad = bytearray(whole)
            bad[pos] ^= 1 << bit
            path.write_bytes(bytes(bad))
            try:  # caught, or a flip that leaves the content as it was (\u00e9 -> \u00E9)
                assert J.Ledger(path, lambda r: r["id"], read_only=True).lines == want, (pos, bit)
            except LoadError as e:
                assert str(e).startswith(f"{path}:2: "), (pos, bit, str(e))
    bad = bytearray(whole)
    bad[whole.index(b'"tau": ', first) + 7] ^= 1  # tau 2.5 -> 3.5 in line 2: still JSON, other content
    path.write_bytes(bytes(bad))
    with pytest.raises(LoadError, match=r"completions.jsonl:2: its checksum does not match its content"):
        J.Ledger(path, lambda r: r["id"])


def test_older_ledgers_without_checksums_are_read_and_new_lines_get_one(tmp_path):
    path = tmp_path / "speed.jsonl"
    old = b'{"id": 0, "v": 1}\n{"id": 1, "v": 2}\n'
    path.write_bytes(old)
    book = J.Ledger(path, lambda r: r["id"])
    assert book.get(1) == {"id": 1, "v": 2}
    book.append({"id": 2, "v": 3})
    book.close()
    assert path.read_bytes() == old + J.seal({"id": 2, "v": 3}).encode() + b"\n"
    assert J.Ledger(path, lambda r: r["id"]).get(2) == {"id": 2, "v": 3}
    path.write_bytes(path.read_bytes() + b'{"id": 3, "v": 4}\n')  # a line whose checksum field was lost
    with pytest.raises(LoadError, match=r"speed.jsonl:4: no _crc32 field after lines that have one"):
        J.Ledger(path, lambda r: r["id"])


def test_a_damaged_compressed_ledger_and_run_json_are_named(tmp_path):
    path = tmp_path / "batches.jsonl"
    _ledger(path)
    assert J.compress(path)
    gz = J.packed(path)
    data = bytearray(gz.read_bytes())
    data[len(data) // 2] ^= 4
    gz.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=r"batches.jsonl.gz: not a whole gzip file"):
        J.Ledger(path, lambda r: r["id"])

    settings = {"model": "random:tiny", "k": 4, "matmul": "auto"}
    B.check_settings(tmp_path, settings)
    B.check_settings(tmp_path, settings)  # the same settings: accepted
    text = (tmp_path / "run.json").read_text()
    assert json.loads(text)[J.CHECK]
    (tmp_path / "run.json").write_text(text.replace('"k": 4', '"k": 5'))
    with pytest.raises(LoadError, match=r"run.json: its checksum does not match its content"):
        B.check_settings(tmp_path, settings | {"k": 5})
    (tmp_path / "run.json").write_text(json.dumps(settings))  # as written before checksums existed
    B.check_settings(tmp_path, settings)




def test_the_binary_ctrl_c_then_finish_then_one_line_for_a_flipped_bit(tmp_path):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = tmp_path / "audit"
    cmd = [sys.executable, str(ROOT / "experiments" / "audit.py"), "--model", "random:tiny", "--draft", "self:1",
           "--k", "2", "--method", "exact", "--mtbench_questions", "2", "--mtbench_max_new_tokens", "4",
           "--humaneval_problems", "0", "--batch_size", "1", "--prompt_bucket", "1024", "--output_dir", str(out)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            cwd=ROOT, preexec_fn=interruptible)
    rest = interrupt_when(proc, " batch 1/2 target-only:")  # a completion is saved
    assert proc.returncode == 130 and "Traceback" not in rest, rest[-2000:]
    assert f"completions are saved in {out}; the same command continues from there" in rest, rest[-2000:]
    assert "[specjax] to go on (or run it again): python " in rest

    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    sums = (out / "tables.sha256").read_text()
    assert {x.split()[1] for x in sums.splitlines()} == {"audit.md", "audit.csv", "audit.json"}
    assert subprocess.run(["sha256sum", "-c", "--quiet", "tables.sha256"], cwd=out).returncode == 0

    path = out / "completions.jsonl"
    data = bytearray(path.read_bytes())
    second = data.index(b"\n") + 1
    data[second + data[second:].index(b'"tau": ') + 7] ^= 1  # a digit of line 2's tau: still a number
    path.write_bytes(bytes(data))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 1 and res.stderr.strip().splitlines() == [
        f"error: {path}:2: its checksum does not match its content: the line was damaged on disk (or edited); "
        "delete that line and rerun to decode it again"], res.stderr[-2000:]
