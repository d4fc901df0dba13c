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


def table(lines: list[dict], target: str) -> str:
    """The table of one target's lines (see experiments/cross_vocab_table.py)."""
    rows = ["| K | rule | drafter | prompts | tau | tokens/s vs target-only (median) | exact = target-only | "
            "on-device tau / this tau |", "|---|---|---|---|---|---|---|---|"]
    mine = [l for l in lines if l["target"] == target]
    base = {(l["dataset"], l["index"]): l for l in mine if l["config"] == "target-only"}
    for k in sorted({l["k"] for l in mine if l["k"]}):
        for method in dict.fromkeys(l["method"] for l in mine if l["k"] == k):
            found = {}  # drafter: (lines, tau)
            for drafter in DRAFTERS:
                got = [l for l in mine if l["k"] == k and l["method"] == method and l["drafter"] == drafter]
                if not got:
                    continue
                if drafter == "transformers":  # its tau counts the target's forward calls per prompt
                    tau = statistics.fmean(l["tau"] for l in got)
                else:  # pooled: tokens from rounds over rounds
                    weights = [max(l.get("rounds") or 0, 1) for l in got]
                    tau = sum(l["tau"] * w for l, w in zip(got, weights)) / sum(weights)
                found[drafter] = (got, tau)
            for drafter, (got, tau) in found.items():
                ratios = [l["tokens_per_s"] / base[(l["dataset"], l["index"])]["tokens_per_s"]
                          for l in got if "tokens_per_s" in l and (l["dataset"], l["index"]) in base]
                same = [l["equals_target_only"] for l in got if "equals_target_only" in l]
                versus = f"{found['cross'][1] / tau:.2f}" if "cross" in found and drafter != "cross" else ""
                rows.append(f"| {k} | {method} | {drafter} | {len(got)} | {tau:.2f} | "
                            f"{f'{statistics.median(ratios):.2f}x' if ratios else '-'} | "
                            f"{f'{sum(same)}/{len(same)}' if method == 'exact' and same else '-'} | {versus} |")
            yard = [found[d][1] for d in ("host", "transformers") if d in found]
            if "cross" in found and yard:
                rows.append(f"| {k} | {method} | **on-device / best yardstick** | | | | | "
                            f"**{found['cross'][1] / max(yard):.2f}** (goal >= 0.9) |")
    return "\n".join(rows)
