"""What experiments/cross_vocab_table.py measures and prints, without its flags (tests import it): the
configurations per prompt, the ledger's key, and the table."""

from __future__ import annotations

import hashlib
import statistics

DRAFTERS = ("cross", "host", "transformers", "same", "pld")


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def key(line: dict) -> tuple:
    return line["target"], line["max_new_tokens"], line["dataset"], line["index"], line["config"]


def prompts(num_humaneval: int, num_mtbench: int) -> list[tuple[str, int, str]]:
    from experiments import data

    return ([("humaneval", i, t) for i, t in enumerate(data.humaneval_messages(num_humaneval))] if num_humaneval else []) + \
        ([("mtbench", i, t) for i, t in enumerate(data.mtbench_questions(num_mtbench))] if num_mtbench else [])


def configs(ks, methods, target: str, same: str) -> list[tuple[str, str, int]]:
    """(drafter, method, k) in the order they are measured per prompt (transformers apart, after)."""
    out = []
    for k in ks:
        for method in methods:
            for drafter in DRAFTERS:
                if drafter == "transformers" or (drafter == "same" and same == target):
                    continue
                out.append((drafter, method, k))
    return out


def label(drafter: str, method: str, k: int) -> str:
    return f"{method}|{drafter}|k={k}"


def _steps(line: dict) -> float:
    """The target's forward passes after the prefill that one measurement made: specjax's rounds, or
    transformers' forward calls (new tokens / its tau; its first call is the prefill and the first
    verification at once, so both count one pass per verification)."""
    if line["drafter"] == "transformers":
        return line["tokens"] / line["tau"]
    return max(line.get("rounds") or 0, 1)


def _pooled_tau(lines: list[dict]) -> float:
    """tau over prompts as a ratio of sums (tokens from verifications / verifications), the same for
    every drafter: a mean of per-prompt ratios would weigh a short reply like a long one."""
    steps = [_steps(l) for l in lines]
    return sum(l["tau"] * s for l, s in zip(lines, steps)) / sum(steps)


def table(lines: list[dict], target: str) -> str:
    """The table of one target's lines (see experiments/cross_vocab_table.py). The on-device tau over
    another drafter's is pooled over the prompts both measured (a prompt transformers failed on is
    left out of both)."""
    rows = ["| K | rule | drafter | prompts | tau | tokens/s vs target-only (median) | exact = target-only | "
            "on-device tau / this tau |", "|---|---|---|---|---|---|---|---|"]
    mine = [l for l in lines if l["target"] == target]
    base = {(l["dataset"], l["index"]): l for l in mine if l["config"] == "target-only"}
    several = len({l.get("machine") for l in base.values()}) > 1
    for k in sorted({l["k"] for l in mine if l["k"]}):
        for method in dict.fromkeys(l["method"] for l in mine if l["k"] == k):
            found = {d: got for d in DRAFTERS
                     if (got := [l for l in mine if l["k"] == k and l["method"] == method and l["drafter"] == d])}
            cross = {(l["dataset"], l["index"]): l for l in found.get("cross", [])}

            def versus(got):  # (on-device tau, this tau) over the prompts both have
                both = [l for l in got if (l["dataset"], l["index"]) in cross]
                return _pooled_tau([cross[(l["dataset"], l["index"])] for l in both]), _pooled_tau(both)

            for drafter, got in found.items():
                same = [l["equals_target_only"] for l in got if "equals_target_only" in l]
                mine_tau, this_tau = versus(got) if cross and drafter != "cross" else (None, None)
                rows.append(f"| {k} | {method} | {drafter} | {len(got)} | {_pooled_tau(got):.2f} | "
                            f"{_speedups(got, base, several)} | "
                            f"{f'{sum(same)}/{len(same)}' if method == 'exact' and same else '-'} | "
                            f"{f'{mine_tau / this_tau:.2f}' if this_tau else ''} |")
            yard = [versus(found[d]) for d in ("host", "transformers") if d in found]
            if cross and yard:
                worst = min(mine_tau / this_tau for mine_tau, this_tau in yard)  # against the best yardstick
                rows.append(f"| {k} | {method} | **on-device / best yardstick** | | | | | "
                            f"**{worst:.2f}** (goal >= 0.9) |")
    return "\n".join(rows)


def _speedups(got: list[dict], base: dict, several: bool) -> str:
    """The median over prompts of tokens/s over target-only's, each prompt against its own target-only
    line (measured beside it); one median per machine where a target's prompts ran on several, as the
    ratio depends on the CPU (its vector units set what a verify of K + 1 costs against one step)."""
    by: dict[str, list[float]] = {}
    for l in got:
        b = base.get((l["dataset"], l["index"]))
        if "tokens_per_s" in l and b is not None:
            by.setdefault(b.get("machine") or "", []).append(l["tokens_per_s"] / b["tokens_per_s"])
    if not by:
        return "-"
    if not several:
        return f"{statistics.median(next(iter(by.values()))):.2f}x"
    return "; ".join(f"{statistics.median(r):.2f}x ({m.split(',')[0]}, {len(r)})" for m, r in by.items())


def where(lines: list[dict], target: str) -> str:
    """Each machine that measured a target's lines, with its dates (the 0.5B's rows, say, can come from
    another sitting and CPU than the 1.5B's)."""
    mine = [l for l in lines if l["target"] == target]
    spans = []
    for machine in dict.fromkeys(l["machine"] for l in mine):
        dates = sorted({l["date"] for l in mine if l["machine"] == machine})
        n = sum(l["machine"] == machine for l in mine)
        spans.append(f"{machine} ({' to '.join(dict.fromkeys([dates[0], dates[-1]]))}, {n} line{'s' * (n != 1)})")
    return "; ".join(spans) or "nothing yet"


def command(lines, values: dict, defaults: dict, output_dir: str) -> str:
    """The cross_vocab_table command that measures a ledger's `lines`: `values` are this run's flags
    (name -> value, lists joined with commas), those equal to `defaults` are left out, and the prompt
    counts are the ledger's own, so a table regenerated with --num_humaneval 0 names what it holds."""
    values = dict(values, num_humaneval=len({l["index"] for l in lines if l["dataset"] == "humaneval"}),
                  num_mtbench=len({l["index"] for l in lines if l["dataset"] == "mtbench"}))
    args = [f"--{name}={value}" for name, value in values.items() if str(value) != str(defaults.get(name))]
    if not any(l["drafter"] == "transformers" for l in lines):
        args.append("--notransformers")
    return " ".join(["python experiments/cross_vocab_table.py", *args, f"--output_dir {output_dir}"])
