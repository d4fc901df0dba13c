r"""What acceptance a draft needs on this machine: speedup against per-token agreement, measured.

A scripted drafter proposes, at each of its K positions, the target's own greedy token with
probability `agreement` and a wrong one otherwise (independently per position), so exact
verification accepts a geometric prefix of known mean. Its tokens come from a target-only run
of the same prompt, so nothing but the agreement is made up: every round runs the real
verify forward, rule and commit, and, with --cost_of=DRAFT, the real drafter's whole proposal
too (its tokens are computed, then replaced), so a round costs what that drafter's round costs.
The table answers "how good must a draft be before speculation pays here", per K: the
break-even agreement and the agreement for a target speedup, against the agreement a real
draft reaches (run benchmark.py for its tau).

    python experiments/break_even.py                                   # SmolLM2, MT-Bench 0-7, free draft
    python experiments/break_even.py --cost_of=none,pld,/tmp/smollm2-draft --k=1,2,4 --agreement=1,0.9,0.8,0.6,0.4

(/tmp/smollm2-draft: a draft from train_draft.py's first example; any draft spec will do.)

Configurations are interleaved prompt by prompt between two target-only runs (as benchmark.py);
tokens/s are totals over the prompts, speedups against the mean of the baselines. The scripted
programs verify every proposal whole (`adaptive=False`): the table is about fixed K.

--empty_round measures instead what a round that proposes nothing costs, in target steps: the
real prompt lookup runs every round but its proposal is dropped (num_draft = 0), so each round
emits one token as target-only decoding does; per prompt and method, the median of --repeats
interleaved runs against the median of as many target-only runs (both generate exactly
--max_new_tokens, no EOS), with the adaptive loop (default: a plain step skips the rule) and
the fixed-K loop (every round scores and verifies).

    python experiments/break_even.py --empty_round --max_new_tokens=96 --num_prompts=4 --repeats=5
"""

from __future__ import annotations

import csv
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

from absl import app, flags, logging

from experiments import _common as C

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Target: preset, .gguf or HF directory.")
_COST = flags.DEFINE_list("cost_of", ["none"], "Whose proposal cost each scripted round pays: none (free: "
                          "no draft computation at all) or a draft spec (pld, self:N, a preset/path, a feature "
                          "draft directory).")
_K = flags.DEFINE_list("k", ["1", "2", "4"], "Draft tokens per round (one program per K and cost).")
_AGREE = flags.DEFINE_list("agreement", ["1", "0.9", "0.8", "0.6", "0.4"], "Per-position probability that a "
                           "scripted draft is the target's token (a runtime value: one program for all).")
_DATASETS = flags.DEFINE_list("datasets", ["mtbench"], "mtbench and/or humaneval (raw completion).")
_NUM = flags.DEFINE_integer("num_prompts", 8, "Prompts per dataset (the first N).")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_TARGET = flags.DEFINE_float("goal", 1.3, "Speedup whose needed agreement the summary reports.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the scripted mistakes.")
_BUCKET = flags.DEFINE_integer("prompt_bucket", 64, "Prompts padded to a multiple of this (Engine's prompt_bucket).")
_CSV = flags.DEFINE_string("csv", "break_even.csv", "Where to write the rows (empty: nowhere).")
_EMPTY = flags.DEFINE_bool("empty_round", False, "Measure the cost of a round that proposes nothing (see above).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "--empty_round: interleaved runs per prompt and configuration.")
_METHODS = flags.DEFINE_list("methods", ["exact", "fly"], "--empty_round: the rules measured.")


class _OneLevel:
    """The adaptive loop's `drafters.Drafter` members, as `drafters.DrafterDefaults` has them (this
    module imports specjax only once its flags are read): one level, never cut short."""

    levels = 1
    truncated = None

    def propose_levels(self, *args, **kwargs):
        out = self.propose(*args, **kwargs)
        return (*out, 0 * out[1])


@dataclasses.dataclass(frozen=True)
class Scripted(_OneLevel):
    """A drafter (`drafters.Drafter`) whose K tokens are the target's own greedy continuation, each replaced by a wrong
    token with probability 1 - agreement. params: {"inner": the costed drafter's params,
    "ref_BS": int32[B, S] prompt + target-only tokens at their positions, "agreement": float32[]}.

    inner: the drafter whose full proposal runs every round (its tokens feed the wrong choices,
    so none of its work is dead code); None: no draft work at all.
    """

    inner: Any
    k: int
    vocab_size: int

    @property
    def uses_features(self) -> bool:
        return getattr(self.inner, "uses_features", False)

    @property
    def name(self) -> str:
        return "scripted" if self.inner is None else f"scripted({self.inner.name})"

    def init(self, params, prompt_BT, prompt_len_B, max_len, *, features_BTD=None, backend=None):
        if self.inner is None:
            return ()
        return self.inner.init(params["inner"], prompt_BT, prompt_len_B, max_len, features_BTD=features_BTD,
                               backend=backend)

    def observe(self, state, features_BRD, base_B):
        return state if self.inner is None else self.inner.observe(state, features_BRD, base_B)

    def propose(self, params, state, seq_BS, lengths_B, key, temperature, *, backend=None):
        import jax
        import jax.numpy as jnp

        key, sub = jax.random.split(key)
        ref_BS = params["ref_BS"]
        B, S = ref_BS.shape
        pos_BK = jnp.minimum(lengths_B[:, None] + 1 + jnp.arange(self.k, dtype=jnp.int32)[None], S - 1)
        ref_BK = jnp.take_along_axis(ref_BS, pos_BK, axis=1)
        other_BK = (ref_BK + 1) % self.vocab_size
        if self.inner is not None:
            d_BK, _, _, state = self.inner.propose(params["inner"], state, seq_BS, lengths_B, key, temperature,
                                                   backend=backend)
            other_BK = jnp.where(d_BK[:, : self.k] == ref_BK, other_BK, d_BK[:, : self.k])
        right_BK = jax.random.uniform(sub, (B, self.k)) < params["agreement"]
        drafts_BK = jnp.where(right_BK, ref_BK, other_BK)
        return drafts_BK, jnp.full((B,), self.k, jnp.int32), None, state


@dataclasses.dataclass(frozen=True)
class Silent(_OneLevel):
    """A drafter (`drafters.Drafter`) that runs `inner`'s whole proposal and then proposes nothing:
    a round costs what proposing costs, and emits one token."""

    inner: Any
    uses_features = False

    @property
    def k(self) -> int:
        return self.inner.k

    @property
    def name(self) -> str:
        return f"silent({self.inner.name})"

    def init(self, params, prompt_BT, prompt_len_B, max_len, *, features_BTD=None, backend=None):
        return self.inner.init(params, prompt_BT, prompt_len_B, max_len, backend=backend)

    def observe(self, state, features_BRD, base_B):
        return state

    def propose(self, params, state, seq_BS, lengths_B, key, temperature, *, backend=None):
        import jax.numpy as jnp

        drafts_BK, num_draft_B, probs_BKV, state = self.inner.propose(params, state, seq_BS, lengths_B, key,
                                                                      temperature, backend=backend)
        # the drafts stay in the program (they are the padding the commit reads), only their count is 0
        return drafts_BK, jnp.zeros_like(num_draft_B), probs_BKV, state


def empty_round(target, prompts) -> None:
    """Prints the cost of a round that proposes nothing, in target steps (see the module docstring)."""
    import jax

    import specjax

    settings = dict(max_new_tokens=_NEW.value, prompt_bucket=_BUCKET.value, eos_ids=())
    baseline = specjax.Engine(target, **settings)
    configs = {}
    for method in _METHODS.value:
        for adaptive in (True, False):
            engine = specjax.Engine(target, draft="pld", method=method, k=int(_K.value[-1]), adaptive=adaptive,
                                    **settings)
            configs[f"{method}, {'adaptive' if adaptive else 'fixed K'}"] = engine

    def timed(engine, ids):
        program, args = engine._prepare([ids])
        if engine.drafter is not None:
            program = dataclasses.replace(program, drafter=Silent(engine.drafter))
        t, cpu = time.perf_counter(), time.process_time()
        out = jax.device_get(program.run(**args))
        return (time.perf_counter() - t, time.process_time() - cpu), int(out.counters.rounds_B[0])

    _log("compiling ...")
    for ids in {baseline.prompt_width([p]): p for p in prompts}.values():
        timed(baseline, ids)
        for engine in configs.values():
            timed(engine, ids)
    ratios = {name: [] for name in configs}  # per prompt: (wall-clock ratio, CPU-time ratio)
    for i, ids in enumerate(prompts):
        base, runs = [], {name: [] for name in configs}
        for _ in range(_REPEATS.value):  # interleaved: target-only, then each configuration, again and again
            base.append(timed(baseline, ids)[0])
            for name, engine in configs.items():
                seconds, rounds = timed(engine, ids)
                assert rounds == _NEW.value - 1, rounds  # one token per round, the first from the prefill
                runs[name].append(seconds)
        for name in configs:
            ratios[name].append(tuple(statistics.median(s[j] for s in runs[name]) / statistics.median(s[j] for s in base)
                                      for j in (0, 1)))
        _log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{n} {r[-1][0]:.3f} (CPU {r[-1][1]:.3f})"
                                                           for n, r in ratios.items()))
    print(f"\nmachine: {C.machine()}; load averages at the end {os.getloadavg()}")
    print(f"target {_MODEL.value}; {len(prompts)} prompts ({', '.join(_DATASETS.value)}); {_NEW.value} new tokens, "
          f"batch 1, K = {_K.value[-1]}; a prompt lookup whose proposal is dropped every round")
    print("cost of a round that proposes nothing, in target-only steps (per prompt: median of "
          f"{_REPEATS.value} interleaved runs / median of as many target-only runs)\n")
    print("CPU time: the process's CPU seconds (all threads), less disturbed than the wall clock on a busy machine\n")
    print("| configuration | wall clock: median over prompts | per prompt | CPU time: median over prompts | per prompt |")
    print("|---|---|---|---|---|")
    for name, r in ratios.items():
        wall, cpu = [x[0] for x in r], [x[1] for x in r]
        print(f"| {name} | {statistics.median(wall):.3f} | {' '.join(f'{x:.3f}' for x in wall)} "
              f"| {statistics.median(cpu):.3f} | {' '.join(f'{x:.3f}' for x in cpu)} |")


def expected_tau(agreement: float, k: int) -> float:
    """Tokens per round of exact verification when each draft is right independently with
    probability `agreement`: 1 + a + a^2 + ... + a^K."""
    return sum(agreement ** i for i in range(k + 1))


def needed(points: list[tuple[float, float]], goal: float) -> float | None:
    """The agreement at which the measured speedup reaches `goal` (linear between measured points;
    None when no measured agreement reaches it)."""
    points = sorted(points)
    for (a0, s0), (a1, s1) in zip(points, points[1:]):
        if s0 < goal <= s1:
            return a0 + (goal - s0) * (a1 - a0) / (s1 - s0)
    if points and points[0][1] >= goal:
        return points[0][0]
    return None


class Config:
    """One (cost, K) program: an engine for the shapes, its Program with the scripted drafter."""

    def __init__(self, target, cost: str, k: int):
        import specjax

        draft = C.resolve_draft(cost, _MODEL.value) if cost != "none" else "pld"
        self.engine = specjax.Engine(target, draft=draft, method="exact", k=k, max_new_tokens=_NEW.value,
                                     prompt_bucket=_BUCKET.value, adaptive=False)
        self.cost, self.k = cost, k
        self.inner = None if cost == "none" else self.engine.drafter

    def run(self, ids, reference, agreement: float, seed: int):
        """(tokens, seconds, statistics) of one scripted generation; `seed` draws its mistakes."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from specjax import loop

        program, args = self.engine._prepare([ids])
        scripted = Scripted(self.inner, self.k, self.engine.target.config.vocab_size)
        program = dataclasses.replace(program, drafter=scripted)
        ref_BS = np.zeros((1, program.max_len), np.int32)
        full = list(ids) + list(reference)
        ref_BS[0, : len(full)] = full[: program.max_len]
        args["seed"] = np.uint32(seed)  # a program input: no recompilation
        args["params"] = loop.Params(target=args["params"].target, draft={
            "inner": args["params"].draft, "ref_BS": jnp.asarray(ref_BS), "agreement": jnp.float32(agreement)})
        t = time.perf_counter()
        out = jax.device_get(program.run(**args))
        seconds = time.perf_counter() - t
        tokens = out.seq_BS[0, len(ids): len(ids) + out.num_out_B[0]].tolist()
        return tokens, seconds, loop.statistics(out.counters, out.rule_state)


def main(argv):
    C.check_output("csv", _CSV.value)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        ks = [int(k) for k in _K.value]
        agreements = [float(a) for a in _AGREE.value]
    except ValueError as e:
        raise app.UsageError(f"--k takes integers and --agreement numbers: {e}") from None
    if not ks or min(ks) < 1:
        raise app.UsageError(f"--k must be one or more integers >= 1, got {_K.value}")
    if not agreements or not all(0.0 <= a <= 1.0 for a in agreements):
        raise app.UsageError(f"--agreement values must lie in [0, 1], got {_AGREE.value}")
    for f in (_NUM, _NEW, _BUCKET, _REPEATS):
        if f.value <= 0:
            raise app.UsageError(f"--{f.name} must be positive")
    logging.set_verbosity(logging.WARNING)
    import specjax
    from specjax import metrics
    from experiments import data

    started = time.perf_counter()
    target = C.load_model(_MODEL.value)
    tok = target.tokenizer
    prompts = []
    for dataset in _DATASETS.value:
        if dataset == "humaneval":
            prompts += [tok.encode(p["prompt"]) for p in data.humaneval_problems(_NUM.value)]
        elif dataset == "mtbench":
            prompts += [tok.chat_prompt_ids(m) for m in data.messages(dataset, _NUM.value)]
        else:
            raise app.UsageError(f"--datasets: unknown {dataset!r} (mtbench, humaneval)")
    if _EMPTY.value:
        return empty_round(target, prompts)
    baseline = specjax.Engine(target, max_new_tokens=_NEW.value, prompt_bucket=_BUCKET.value)
    configs = [Config(target, cost, k) for cost in _COST.value for k in ks]
    keys = [(c, a) for c in configs for a in agreements]
    _log(f"compiling {1 + len(configs)} programs ...")
    for ids in {baseline.prompt_width([p]): p for p in prompts}.values():
        reference = baseline.generate([ids]).tokens[0]
        for c in configs:
            c.run(ids, reference, 1.0, 0)
    _log("measuring ...")
    base_tokens, base_seconds, drift = 0, 0.0, []
    tallies = {key: [0, 0.0, [], 0] for key in keys}  # tokens, seconds, stats, diverged
    for i, ids in enumerate(prompts):
        t = time.perf_counter()
        reference = baseline.generate([ids]).tokens[0]
        first = time.perf_counter() - t
        for c, a in keys:
            # each prompt its own mistakes (one seed for every prompt would repeat one sample of
            # rounds), the same for every configuration (common random numbers for the comparison)
            tokens, seconds, stats = c.run(ids, reference, a, _SEED.value * 100_003 + i)
            tally = tallies[(c, a)]
            tally[0] += len(tokens)
            tally[1] += seconds
            tally[2].append(stats)
            tally[3] += tokens != reference
        t = time.perf_counter()
        baseline.generate([ids])
        second = time.perf_counter() - t
        base_tokens += 2 * len(reference)
        base_seconds += first + second
        drift.append(second / first)
        _log(f"prompt {i + 1}/{len(prompts)} done ({time.perf_counter() - started:.0f}s elapsed)")

    base_tps = base_tokens / base_seconds
    rows = []
    for (c, a), (tokens, seconds, stats, diverged) in tallies.items():
        merged = metrics.merge(stats)
        rows.append(dict(cost_of=c.cost, k=c.k, agreement=a, expected_tau=expected_tau(a, c.k), tau=merged["tau"],
                         first_acceptance=merged["accepted_per_position"][0], tokens_per_s=tokens / seconds, speedup=tokens / seconds / base_tps,
                         round_cost=merged["tau"] / (tokens / seconds / base_tps), divergence=diverged / len(prompts)))
    print(f"\nmachine: {C.machine()}; load averages at the end {os.getloadavg()}")
    print(f"target {_MODEL.value}; {len(prompts)} prompts ({', '.join(_DATASETS.value)}); max_new_tokens="
          f"{_NEW.value}; batch 1; exact verification; target-only {base_tps:.1f} tokens/s")
    print(f"baseline drift (second/first run of each prompt): median {statistics.median(drift):.3f}, "
          f"range {min(drift):.3f}-{max(drift):.3f}; wall time {time.perf_counter() - started:.0f}s")
    print("round cost: target steps per round (tau / speedup); divergence: share of prompts whose tokens differ "
          "from target-only\n")
    print("| cost of | K | agreement | first draft accepted | expected tau | tau | tokens/s | speedup | round cost "
          "| divergence |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cost_of']} | {r['k']} | {r['agreement']:.2f} | {r['first_acceptance']:.2f} "
              f"| {r['expected_tau']:.2f} | {r['tau']:.2f} "
              f"| {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['round_cost']:.2f} | {r['divergence']:.2f} |")
    print(f"\n| cost of | K | break-even agreement (1.0x) | agreement for {_TARGET.value}x | speedup at the highest agreement |")
    print("|---|---|---|---|---|")
    for c in configs:
        points = [(r["agreement"], r["speedup"]) for r in rows if r["cost_of"] == c.cost and r["k"] == c.k]
        fmt = lambda x: "not reached" if x is None else f"{x:.2f}"  # noqa: E731
        top = max(points)[1]
        print(f"| {c.cost} | {c.k} | {fmt(needed(points, 1.0))} | {fmt(needed(points, _TARGET.value))} | {top:.2f} |")
    if _CSV.value:
        with C.atomic_open(_CSV.value, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nwrote {_CSV.value}")


def _log(msg):
    print(f"[break_even] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    C.run_main(main)
