"""The audit's decoding: its methods (a rule spec and its engines), the quality pass batch by batch, the
MT-Bench log-probability proxy and the batch-1 speed pass. Every function appends to the run's ledgers
(`_audit_books.ledgers`) as it goes, so a killed run loses at most what was in flight."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from absl import app

from specjax import models, verify

from experiments import _common as C, _humaneval as H

REFERENCE = "target-only"


@dataclasses.dataclass(frozen=True)
class Options:
    """The audit's flags that decoding reads (experiments/audit.py fills it)."""
    model: str  # the target's spec, for drafts named relative to it (self:N)
    draft: str  # the default drafter
    k: int  # the default draft length
    batch_size: int
    prompt_bucket: int
    matmul: str
    exec_timeout: float
    adaptive: bool = True  # the draft length chosen per round (Engine's default); False: every round K
    temperature: float = 0.0  # every method's, target-only included (0: greedy)
    seed: int = 0  # the Engine's sampling seed


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
    def __init__(self, spec: str, target: models.Model, max_new_tokens: dict[str, int], opts: Options):
        self.spec = spec
        self.engines: dict[str, Any] = {}
        if spec == REFERENCE:
            self.method, self.draft, self.k, self.options, draft, k = "greedy", "none", None, {}, None, 1
        else:
            rule_spec, scale = split_spec(spec)
            method, options = C.parse_method_spec(rule_spec)
            self.draft = options.pop("draft", opts.draft)
            self.k = k = options.pop("k", opts.k)
            if self.k <= 0:
                raise app.UsageError(f"method spec {spec!r}: k must be positive")
            self.method = method
            self.options = C.apply_calibration(method, options, target.config.vocab_size, self.k)
            if scale is not None:
                self.options["budget"] = scale * self.options.get("budget", verify.rule("asd").budget)
            draft = C.resolve_draft(self.draft, opts.model)
            if draft is None:
                raise app.UsageError(f"method spec {spec!r}: needs a drafter (--draft or draft=)")
        for part, new in max_new_tokens.items():
            extra = {} if draft is None else {"adaptive": opts.adaptive}
            self.engines[part] = C.make_engine(target, draft, self.method, k, new, matmul=opts.matmul,
                                               prompt_bucket=opts.prompt_bucket, temperature=opts.temperature,
                                               seed=opts.seed, **extra, **self.options)

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


def quality(part: Part, methods: list[Method], tokenizer, books, progress: Progress, deadline,
            opts: Options) -> bool:
    """Decodes every missing (task, method) of a part, batch by batch; False when the time budget ended it."""
    completions, results, batches = books["completions"], books["results"], books["batches"]
    for bi, batch in enumerate(C.chunks(part.tasks, opts.batch_size)):
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
                                            opts.exec_timeout)
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
            if opts.batch_size == 1 and (part.name, batch[0].task_id, m.spec) not in books["speed"]:
                # one prompt, every method in turn, compilation apart: this is the speed pass's timing
                books["speed"].append({"part": part.name, "task_id": batch[0].task_id, "method": m.spec,
                                       "tokens": len(out.tokens[0]), "seconds": gen_s, "cpu": C.cpu()})
            n_tokens = sum(len(out.tokens[i]) for i in rows)
            batches.append({"part": part.name, "batch": bi, "method": m.spec, "rows": len(rows),
                            "batch_rows": len(batch), "tokens": n_tokens, "generate_seconds": gen_s,
                            "compile_seconds": compile_s, "check_seconds": check_s})
            C.log(f"{part.title} batch {bi + 1}/{-(-len(part.tasks) // opts.batch_size)} {m.spec}: "
                  f"{n_tokens} tokens in {gen_s:.1f}s; " + progress.add(len(rows), n_tokens, gen_s))
    return True


def mean_logprob(target: models.Model, prompt: list[int], answer: list[int], bucket: int) -> float:
    """The target's mean log-probability per token of `answer` after `prompt` (one teacher-forced forward)."""
    import jax

    from experiments import _rounds as R
    seq = list(prompt) + list(answer)
    logits = R.teacher_forced(target, seq, bucket)[len(prompt) - 1: len(seq) - 1]
    logp = jax.nn.log_softmax(logits.astype(np.float32), axis=-1)
    return float(np.mean(np.take_along_axis(np.asarray(logp), np.asarray(answer)[:, None], axis=1)))


def score_answers(part: Part, methods: list[Method], target: models.Model, books, bucket: int) -> None:
    """mtbench_logprob.jsonl: the proxy score of every finished MT-Bench answer (identical answers scored once)."""
    completions, scores = books["completions"], books["logprob"]
    cache: dict[tuple, float] = {}
    todo = [(t, m) for t in part.tasks for m in methods
            if (t.task_id, m.spec) in completions and (t.task_id, m.spec) not in scores]
    for n, (t, m) in enumerate(todo, 1):
        tokens = completions.get((t.task_id, m.spec))["tokens"]
        key = (t.task_id, tuple(tokens))
        if key not in cache:
            cache[key] = mean_logprob(target, t.ids, tokens, bucket)
        scores.append({"task_id": t.task_id, "method": m.spec, "mean_logprob": cache[key], "tokens": len(tokens)})
        if n % 20 == 0 or n == len(todo):
            C.log(f"MT-Bench log-probability proxy: {n}/{len(todo)} answers scored")


def speed(part: Part, methods: list[Method], books, deadline, wanted: int) -> bool:
    """Batch-1 timing of the first `wanted` prompts, methods interleaved per prompt; False when the time
    budget ended it.

    Also the repair of timings that are missing after the fact: at batch 1 the quality pass times each
    prompt as it decodes it, and a row whose write failed (a full disk, then a resumed run) would
    otherwise never come back, since its completion is there. Such a prompt is timed here again, for
    its missing methods only (said in the log: they are timed in another sitting than the rest)."""
    timed = books["speed"]
    tasks = part.tasks[:wanted]
    for n, t in enumerate(tasks, 1):
        pending = [m for m in methods if (part.name, t.task_id, m.spec) not in timed]
        if not pending:
            continue
        if deadline is not None and time.perf_counter() > deadline:
            C.log(f"time budget reached: stopped timing {part.title} before prompt {n}; rerun to continue")
            return False
        if len(pending) < len(methods):
            C.log(f"{part.title} speed: {t.task_id} lacks the timing of {', '.join(m.spec for m in pending)}: "
                  "timed again now")
        for m in pending:
            engine = m.engines[part.name]
            C.compile_for(engine, [[t.ids]])
            start = time.perf_counter()
            out = engine.generate([t.ids])
            seconds = time.perf_counter() - start
            timed.append({"part": part.name, "task_id": t.task_id, "method": m.spec,
                          "tokens": len(out.tokens[0]), "seconds": seconds, "cpu": C.cpu()})
        C.log(f"{part.title} speed: prompt {n}/{len(tasks)} timed for every method")
    return True
