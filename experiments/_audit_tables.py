"""The audit's statistics and tables, from its ledgers alone: per part and method, pass@1, recovery and
McNemar (HumanEval), divergence, the log-probability proxy (MT-Bench), tau, speed from the batch-1
pass and cost from the quality pass; then audit.md's tables and the pass@1-against-speed plot.

A speed cell the run meant to fill and could not (its timing rows are missing: a sitting's time budget
ended first, or their writes failed) says "not timed", never blank."""

from __future__ import annotations

import io
import pathlib
from typing import Any

import numpy as np

from experiments import _audit_stats as S, _common as C
from experiments._audit_run import REFERENCE, Method, Part, split_spec

NOT_TIMED = "not timed"
UNRECORDED = "CPU not recorded"  # timing rows written before the audit named the CPU in each


def summarize(part: Part, methods: list[Method], books, wanted_speed: int, seed: int) -> dict:
    """Per method: the statistics over the tasks every method has finished."""
    completions = books["completions"]
    specs = [m.spec for m in methods]
    done = [t for t in part.tasks if all((t.task_id, s) in completions for s in specs)]
    lines = {s: [completions.get((t.task_id, s)) for t in done] for s in specs}
    timed_ids = [t.task_id for t in part.tasks[:wanted_speed]
                 if all((part.name, t.task_id, s) in books["speed"] for s in specs)]
    timing = {s: [books["speed"].get((part.name, i, s)) for i in timed_ids] for s in specs}
    tps = _tokens_per_second(timing)
    by_cpu = _speed_by_cpu(timing, specs)
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
        peer = exact_peer(s, specs)
        if tps[s] and peer and tps[peer]:
            row["speedup_vs_exact"], row["exact_peer"] = tps[s] / tps[peer], peer
        if s in cost:
            n, wall, comp = cost[s]
            row["audit_seconds_per_100"] = 100 * wall / n
            row["compile_seconds"] = comp
        if by_cpu:
            row["speed_by_cpu"] = by_cpu[s]
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


def _tokens_per_second(timing: dict[str, list[dict]]) -> dict[str, float | None]:
    return {s: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) if rs else None
            for s, rs in timing.items()}


def _speed_by_cpu(timing: dict[str, list[dict]], specs: list[str]) -> dict[str, dict] | None:
    """Per method, its speedups over the prompts each CPU timed; None where no row names its CPU.

    A run that resumes on another machine pools timings from CPUs of different vector widths, and a
    CPU verify is compute-bound, so the ratios differ between them: the pooled figure is read beside
    each CPU's. A prompt's methods run in turn in one sitting, so one CPU times them all; a prompt
    whose rows name several (a timing repaired in a later sitting) is counted under their join."""
    n = len(next(iter(timing.values()), []))
    cpus = ["; ".join(sorted({timing[s][i].get("cpu", UNRECORDED) for s in specs})) for i in range(n)]
    if all(c == UNRECORDED for c in cpus):
        return None
    out: dict[str, dict] = {s: {} for s in specs}
    for cpu in sorted(set(cpus), key=cpus.index):
        tps = _tokens_per_second({s: [r for r, c in zip(rs, cpus) if c == cpu] for s, rs in timing.items()})
        for s in specs:
            peer = exact_peer(s, specs)
            out[s][cpu] = {"prompts": cpus.count(cpu),
                           "speedup_vs_target_only": tps[s] / tps[REFERENCE],
                           "speedup_vs_exact": tps[s] / tps[peer] if peer else None}
    return out


def exact_peer(spec: str, specs: list[str]) -> str | None:
    """The exact spec that `spec`'s speedup over exact is read against: the one with its own K and
    draft (`fly:k=25` against `exact:k=25`, so that a K or draft ablation compares like with like),
    else the run's plain `exact`; None without one."""
    def options(s: str) -> tuple[str, dict]:
        return C.parse_method_spec(split_spec(s)[0])

    want = {} if spec == REFERENCE else {k: v for k, v in options(spec)[1].items() if k in ("k", "draft")}
    if want:
        for other in specs:
            if other != REFERENCE and options(other) in (("exact", want), ("greedy", want)):
                return other
    return "exact" if "exact" in specs else None


def _f(x, d=3):
    """A table cell: blank for a value that does not apply (None, nan)."""
    return "" if x is None or x != x else (f"{x:.{d}f}" if isinstance(x, float) else str(x))


def markdown(parts: list[Part], summaries: dict, wall: float | None, settings: dict, machine: str) -> str:
    """audit.md: one table of quality and speed and one of cost per part (wall None: no sitting, a report)."""
    batch = settings["batch_size"]
    sampled = (f"; sampled at T = {settings['temperature']:g}, seed {settings['seed']}"
               if settings.get("temperature") else "")
    out = [f"Audit: target {settings['model']}, default draft {settings['draft']}, k {settings['k']}, batch {batch}, "
           f"prompt bucket {settings['prompt_bucket']}, matmul {settings['matmul']}{sampled}; {machine}"
           + ("." if wall is None else f"; this sitting {wall / 60:.1f} min."), ""]
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
                           f"{_speed(r, 'speedup_vs_target_only')} | {_speed(r, 'speedup_vs_exact')} |")
        else:
            out += ["| method | divergence | first diff (median / min) | target log-prob/token [95%] | "
                    "vs target-only [95% paired] " + speed_cols, "|---|---|---|---|---|---|---|---|---|"]
            for s, r in rows.items():
                out.append(f"| {s} | {_f(r['divergence'], 2)} ({r['diverged']}/{r['n']}) | "
                           f"{_f(r['first_diff_median'], 0)} / {_f(r['first_diff_min'])} | {_f(r.get('logprob'))} "
                           f"[{_f(r.get('logprob_lo'))}, {_f(r.get('logprob_hi'))}] | {_f(r.get('logprob_diff'))} "
                           f"[{_f(r.get('logprob_diff_lo'))}, {_f(r.get('logprob_diff_hi'))}] | {_f(r['tau'], 2)} | "
                           f"{_f(r['loose_per_answer'], 2)} | {_speed(r, 'speedup_vs_target_only')} | "
                           f"{_speed(r, 'speedup_vs_exact')} |")
            out += ["", "The log-probability is a proxy, not a quality judgement: the target's own mean "
                    "log-probability per token of each answer (teacher-forced), which target-only greedy "
                    "answers nearly maximise; a negative difference says a method's answers stray from what "
                    "the target would say, not that a reader would find them worse."]
        out += _cpu_lines(rows)
        out += ["", f"Cost ({part.title}): wall seconds per 100 prompts, generation plus sandbox, at batch "
                f"{batch} (compilation apart) against batch-1 generation in the speed pass:", "",
                f"| method | batch {batch}: generation + sandbox s/100 | batch 1: generation s/100 | compile s |",
                "|---|---|---|---|"]
        for s, r in rows.items():
            out.append(f"| {s} | {_f(r.get('audit_seconds_per_100'), 0) or NOT_TIMED} | "
                       f"{_f(r.get('batch1_seconds_per_100'), 0) or NOT_TIMED} "
                       f"| {_f(r.get('compile_seconds'), 0)} |")
        out.append("")
    return "\n".join(out) + "\n"


def _cpu_lines(rows: dict) -> list[str]:
    """Which CPU timed the speed columns; where several did, each one's speedups beside the pooled."""
    by_cpu = rows[REFERENCE].get("speed_by_cpu")
    if not by_cpu:
        return []
    out = ["", "Timed on: " + ", ".join(f"{c} ({v['prompts']} prompt{'s' * (v['prompts'] != 1)})" for c, v in by_cpu.items()) + "."]
    if len(by_cpu) > 1:
        out += ["", "| method | " + " | ".join(f"vs target-only, vs exact on {c}" for c in by_cpu) + " |",
                "|---|" + "---|" * len(by_cpu)]
        for s, r in rows.items():
            out.append(f"| {s} | " + " | ".join(f"{_f(v['speedup_vs_target_only'], 2)}, {_f(v['speedup_vs_exact'], 2)}"
                                               for v in r["speed_by_cpu"].values()) + " |")
    return out


def _speed(row: dict, key: str) -> str:
    """A speedup cell: "not timed" where the method has no batch-1 timing (a blank would read as n/a);
    a speedup over exact names its exact spec where that is not the plain `exact`."""
    if row.get("tokens_per_s") is None:
        return NOT_TIMED
    cell = _f(row.get(key), 2)
    peer = row.get("exact_peer")
    return f"{cell} (vs {peer})" if key == "speedup_vs_exact" and cell and peer not in (None, "exact") else cell


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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    # a palette of 64 colours: a quarter of the bytes of matplotlib's RGBA file, for results kept in git
    from PIL import Image

    Image.open(buf).convert("RGB").quantize(colors=64).save(path, format="PNG", optimize=True)


def result(books, task_id, spec) -> dict:
    """The sandbox's verdict text of a HumanEval completion, for audit.json's records."""
    r = books["results"].get((task_id, spec))
    return {"result": r["result"]} if r else {}


