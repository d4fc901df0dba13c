"""The audit's files: its ledgers (JSON lines, appended as it goes, plain or compressed), the settings
a rerun must share (run.json), copying from an earlier run (--reuse_from) and compressing a finished run
(--compress: every X.jsonl -> X.jsonl.gz and audit.json -> audit.json.xz; a later run reads them and
appends new lines beside them)."""

from __future__ import annotations

import gzip
import json
import lzma
import os
import pathlib
import types
import zlib

from absl import app

from specjax._files import LoadError, sha256_file

from experiments import _audit_tables as T, _common as C, _jsonl as J
from experiments._audit_run import REFERENCE, Method, Part, Task

LEDGERS = {"completions": "completions.jsonl", "results": "humaneval_results.jsonl",
           "logprob": "mtbench_logprob.jsonl", "speed": "speed.jsonl", "batches": "batches.jsonl",
           "reused": "reused.jsonl"}

# settings added after runs were recorded without them: a missing one had this value (the runs
# recorded before the adaptive loop existed verified K tokens every round)
_SETTING_DEFAULTS = {"matmul": "auto", "adaptive": False, "temperature": 0.0, "seed": 0}


def _settings_changed(before: dict, now: dict) -> list[str]:
    return [f"--{k} {before.get(k, _SETTING_DEFAULTS.get(k))!r} -> {v!r}" for k, v in now.items()
            if before.get(k, _SETTING_DEFAULTS.get(k)) != v]


def read_settings(path: pathlib.Path) -> dict:
    """A run.json's settings, its checksum verified (`write_settings`); one written before checksums
    existed (the committed audits) is read as it is. LoadError naming the file when it is damaged."""
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise LoadError(path, f"not a JSON file ({e}): damaged, or not written by the audit") from None
    if not isinstance(settings, dict):
        raise LoadError(path, "not a JSON object: damaged, or not written by the audit")
    if J.CHECK in settings and settings.pop(J.CHECK) != _settings_crc(settings):
        raise LoadError(path, "its checksum does not match its content: damaged on disk (or edited)")
    return settings


def _settings_crc(settings: dict) -> str:
    return f"{zlib.crc32(json.dumps(settings, sort_keys=True).encode()):08x}"


def write_settings(path: pathlib.Path, settings: dict) -> None:
    C.write_text(path, json.dumps(settings | {J.CHECK: _settings_crc(settings)}, indent=1) + "\n")


def check_settings(out_dir: pathlib.Path, now: dict) -> None:
    """Records `now` as the run's settings in run.json, or refuses a rerun with other ones."""
    path = out_dir / "run.json"
    if path.exists():
        changed = _settings_changed(read_settings(path), now)
        if changed:
            raise app.UsageError(f"{out_dir} holds an audit run with other settings ({'; '.join(changed)}); "
                                 "rerun with the same flags to continue it, or use another --output_dir")
    else:
        write_settings(path, now)


def ledgers(out_dir: pathlib.Path, read_only: bool = False) -> dict[str, J.Ledger]:
    """The run's JSON-lines files, keyed; read_only leaves a cut-off last line in place (another run's)."""
    by_task = lambda r: (r["task_id"], r["method"])  # noqa: E731
    by_batch = lambda r: (r["part"], r["batch"], r["method"])  # noqa: E731
    paths = {k: out_dir / name for k, name in LEDGERS.items()}
    return {"completions": J.Ledger(paths["completions"], by_task, read_only=read_only),
            # a verdict may be rewritten after a kill between its write and its completion's
            "results": J.Ledger(paths["results"], by_task, unique=False, read_only=read_only),
            "logprob": J.Ledger(paths["logprob"], by_task, read_only=read_only),
            "speed": J.Ledger(paths["speed"], lambda r: (r["part"], r["task_id"], r["method"]),
                              read_only=read_only),
            "batches": J.Ledger(paths["batches"], by_batch, unique=False, read_only=read_only),
            "reused": J.Ledger(paths["reused"], by_task, read_only=read_only)}


def check_reuse_source(source: pathlib.Path, out_dir: pathlib.Path, now: dict) -> None:
    """--reuse_from must name another finished-or-not audit directory recorded with this run's settings."""
    if source.resolve() == out_dir.resolve():
        raise app.UsageError(f"--reuse_from {source}: that is --output_dir itself")
    if not (source / "run.json").is_file() or not J.exists(source / "completions.jsonl"):
        raise app.UsageError(f"--reuse_from {source}: not an audit output directory (no run.json and "
                             "completions.jsonl(.gz) there)")
    changed = _settings_changed(read_settings(source / "run.json"), now)
    if changed:
        raise app.UsageError(f"--reuse_from {source}: recorded with other settings ({'; '.join(changed)}); "
                             "its completions are not what this run would decode")


def reuse(source: pathlib.Path, parts: list[Part], methods: list[Method], books, batch_size: int) -> int:
    """Copies the source run's completions of this run's (task, method) pairs; returns how many.

    A pair is copied with target-only's line for its task (first_diff refers to it), so a task
    whose target-only this run already decoded differently is left alone (it cannot happen with
    the same settings; checked rather than assumed)."""
    src = ledgers(source, read_only=True)
    ours, copied = books["completions"], 0
    for part in parts:
        for bi, batch in enumerate(C.chunks(part.tasks, batch_size)):
            taken = {m.spec: 0 for m in methods}  # rows of this batch copied now, per method
            for t in batch:
                ref = src["completions"].get((t.task_id, REFERENCE))
                mine = ours.get((t.task_id, REFERENCE))
                if ref is None or (mine is not None and mine["tokens"] != ref["tokens"]):
                    continue
                for m in methods:  # target-only first, so a copied line's reference is there
                    key = (t.task_id, m.spec)
                    line = src["completions"].get(key)
                    if key in ours or line is None or (m.spec != REFERENCE and (t.task_id, REFERENCE) not in ours):
                        continue
                    if part.name == "humaneval":
                        verdict = src["results"].get(key)
                        if verdict is None:  # the source was killed between its two writes: decode it here
                            continue
                        books["results"].append(verdict)
                    if key in src["logprob"]:
                        books["logprob"].append(src["logprob"].get(key))
                    ours.append(line)
                    books["reused"].append({"task_id": t.task_id, "method": m.spec, "source": str(source)})
                    taken[m.spec] += 1
            for m in methods:  # a batch's time only where this run took the whole batch from the source
                key = (part.name, bi, m.spec)
                if taken[m.spec] == len(batch) and key in src["batches"] and key not in books["batches"]:
                    books["batches"].append(src["batches"].get(key))
            copied += sum(taken.values())
    for b in src.values():
        b.close()
    return copied


# A compressed run's record is xz, not gzip: its records list every method's answers one method after
# another, so equal answers lie a method apart (hundreds of kB), beyond gzip's 32 kB window; xz's window
# spans the file (an audit of 164 problems: 523 kB as gzip, 97 kB as xz). audit.json.gz is the form
# runs compressed before 2026-12-07 kept; --compress or a rerun replaces it.
RECORD, PACKED_RECORD, OLD_RECORD = "audit.json", "audit.json.xz", "audit.json.gz"
_RECORD_BYTES = {RECORD: lambda p: p.read_bytes(), PACKED_RECORD: lambda p: lzma.decompress(p.read_bytes()),
                 OLD_RECORD: lambda p: gzip.decompress(p.read_bytes())}  # the JSON's bytes of each form


def record_path(out_dir: pathlib.Path) -> pathlib.Path:
    """audit.json, or audit.json.xz in a compressed run (where a rerun writes its record compressed too)."""
    return out_dir / (PACKED_RECORD if J.packed(out_dir / LEDGERS["completions"]).exists() else RECORD)


def write_record(out_dir: pathlib.Path, text: str) -> pathlib.Path:
    """Writes audit.json (or .xz, see `record_path`) and removes the other forms, left by an earlier sitting."""
    path = record_path(out_dir)
    C.write_text(out_dir / RECORD, text)  # atomically, then compressed: a kill leaves one whole file
    if path.name == PACKED_RECORD:
        compress_record(out_dir)
    else:
        for name in (PACKED_RECORD, OLD_RECORD):
            (out_dir / name).unlink(missing_ok=True)
    return path


def read_record(out_dir: pathlib.Path) -> dict:
    """The record in whichever form the run holds: audit.json, audit.json.xz or the older audit.json.gz."""
    for name, read in _RECORD_BYTES.items():
        if (out_dir / name).is_file():
            return json.loads(read(out_dir / name))
    raise FileNotFoundError(f"{out_dir}: no {RECORD}, {PACKED_RECORD} or {OLD_RECORD}")


TABLE_SUMS = "tables.sha256"


def report(out_dir: pathlib.Path, machine: str) -> str:
    """--report: audit.md's tables from the run's ledgers as they stand, a running audit's too (they are
    read, never written, and no model loads). The parts, their sizes and the methods' order are the
    record's where the run has one, else what the ledgers hold."""
    if not (out_dir / "run.json").is_file():
        raise app.UsageError(f"--report {out_dir}: not an audit output directory (no run.json there)")
    settings = {"matmul": "auto", "bootstrap_seed": 0, **read_settings(out_dir / "run.json")}
    books = ledgers(out_dir, read_only=True)
    try:
        record = read_record(out_dir)
    except FileNotFoundError:
        record = {"parts": {}}
    keys = list(books["completions"].lines)
    specs = list(dict.fromkeys([REFERENCE, *(m["spec"] for p in record["parts"].values() for m in p["methods"]),
                                *(s for _, s in keys)]))
    parts, summaries = [], {}
    for name, title, prefix in (("mtbench", "MT-Bench", "MT-Bench/"), ("humaneval", "HumanEval", "HumanEval/")):
        held = [int(t[len(prefix):]) + 1 for t, _ in keys if t.startswith(prefix)]
        n = max([*held, record["parts"].get(name, {}).get("tasks", 0)], default=0)
        if not n:
            continue
        part = Part(name, title, [Task(f"{prefix}{i}", []) for i in range(n)], settings[f"{name}_max_new_tokens"])
        timed = {k[1] for k in books["speed"].lines if k[0] == name}
        wanted = n if settings["batch_size"] == 1 else len(timed)
        here = {s for t, s in keys if t.startswith(prefix)}  # a method with no answer here yet has no row
        methods = [types.SimpleNamespace(spec=s) for s in specs if s in here]  # the tables read only .spec
        parts.append(part)
        summaries[name] = T.summarize(part, methods, books, wanted, settings["bootstrap_seed"])
    for b in books.values():
        b.close()
    if not parts:
        raise app.UsageError(f"--report {out_dir}: no completion finished yet")
    return T.markdown(parts, summaries, None, settings, machine)


def write_table_sums(out_dir: pathlib.Path, names: list[str]) -> None:
    """tables.sha256: the SHA-256 of the tables the audit only writes (audit.md, .csv, .json(.xz),
    pareto.png), in `sha256sum` format, so `sha256sum -c tables.sha256` in the directory checks them.
    (The ledgers and run.json carry checksums of their own, verified whenever the audit reads them.)"""
    rows = [f"{sha256_file(out_dir / n)}  {n}\n" for n in names if (out_dir / n).is_file()]
    C.write_text(out_dir / TABLE_SUMS, "".join(rows))


def compress_record(out_dir: pathlib.Path) -> str | None:
    """audit.json (or an older run's audit.json.gz) -> audit.json.xz, atomically; the name it compressed."""
    for name in (RECORD, OLD_RECORD):
        if (out_dir / name).is_file():
            tmp = out_dir / (PACKED_RECORD + ".tmp")  # xz holds no time: the same JSON, the same bytes
            tmp.write_bytes(lzma.compress(_RECORD_BYTES[name](out_dir / name), preset=9))
            os.replace(tmp, out_dir / PACKED_RECORD)
            for old in (RECORD, OLD_RECORD):
                (out_dir / old).unlink(missing_ok=True)
            return name
    return None


def compress_run(out_dir: pathlib.Path) -> list[str]:
    """--compress: folds every ledger of a run into its .jsonl.gz and audit.json into audit.json.xz; the
    names of what was compressed. The lines are kept byte for byte (gzip), so the tables a rerun writes
    from them are the same."""
    if not (out_dir / "run.json").is_file():
        raise app.UsageError(f"--compress {out_dir}: not an audit output directory (no run.json there)")
    done = []
    for name in LEDGERS.values():
        try:
            if J.compress(out_dir / name):
                done.append(name)
        except ValueError as e:
            raise app.UsageError(f"--compress: {e}") from None
    record = compress_record(out_dir)
    if record:
        done.append(record)
        if (out_dir / TABLE_SUMS).is_file():  # it named the record's earlier form
            write_table_sums(out_dir, ["audit.md", "audit.csv", PACKED_RECORD, "pareto.png"])
    return done

