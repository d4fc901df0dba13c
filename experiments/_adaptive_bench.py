"""The adaptive-K benchmark's logic (`benchmark_adaptive.py` is its command line).

Rows are (rule, drafter, K): fixed K (`Engine(adaptive=False)`) beside the adaptive loop at the
largest K. Per prompt, target-only runs first and then every row on the same prompt
(interleaved, so that a machine's slow minute hits all of them alike); each measurement is one
line of a ledger (`_jsonl.Ledger`), so a killed run resumes where it stopped. The table gives
per row the median over prompts of its tokens/s ratio to the same prompt's target-only run.

Two figures besides: what a round with nothing proposed costs in target steps (the adaptive
loop forced to width 1 by a cost table where every wider verify is dear: a round that verifies
only the pending token, with the drafter's search and the policy's bookkeeping still in it),
and the widths the same policy would choose under the H200 cost profile of
experiments/results/device_h200_engine.md (a `CostTable` computed from that file's batch-1
figures, from each row's measured acceptance at the largest fixed K).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import inspect
import os
import pathlib
import re
import statistics
import time
from typing import Any, Sequence

import numpy as np

import specjax

from experiments import _jsonl

H200_PROFILE = pathlib.Path(__file__).parent / "results" / "device_h200_engine.md"
PUBLISHED_FLY = "fly:rule=reference,entropy=top3"  # FLy's published rule, as the audit spells it
METHOD_LABELS = {"exact": "exact", "fly": "FLy defaults", PUBLISHED_FLY: "FLy published"}


def has_adaptive() -> bool:
    """Whether this specjax's Engine takes `adaptive=` (the loop that chooses the width per round)."""
    return "adaptive" in inspect.signature(specjax.Engine.__init__).parameters


def carries_adaptation() -> bool:
    """Whether this specjax's generate takes `adaptation=` (the policy's counts carried between calls)."""
    return "adaptation" in inspect.signature(specjax.Engine.generate).parameters


def _adaptation(line: dict | None):
    """The policy's counts an adaptive measurement left (its ledger line's), or None."""
    if not line or not line.get("adaptation"):
        return None
    from specjax import loop

    hits, trials = (np.asarray(line["adaptation"][k], np.float32) for k in ("hits", "trials"))
    return loop.Adapt(hits_LK=hits, trials_LK=trials, widths_W=np.zeros((hits.shape[1] + 2,), np.int32))


@dataclasses.dataclass(frozen=True)
class Row:
    method: str  # a method spec: "exact", "fly", "fly:rule=reference,entropy=top3"
    draft: str  # "pld" or a draft model spec
    k: int
    adaptive: bool

    @property
    def label(self) -> str:
        return f"{self.method}|{self.draft}|k={self.k}|{'adaptive' if self.adaptive else 'fixed'}"

    @property
    def group(self) -> tuple[str, str]:
        return self.method, self.draft


TARGET = "target-only"


def rows(methods: Sequence[str], drafts: Sequence[str], ks: Sequence[int], adaptive: bool) -> list[Row]:
    out = []
    for method in methods:
        for draft in drafts:
            out += [Row(method, draft, k, False) for k in ks]
            if adaptive:
                out.append(Row(method, draft, max(ks), True))
    return out


def prompts(num_humaneval: int, num_mtbench: int) -> list[tuple[str, int, str]]:
    """(dataset, index, user message): HumanEval chat requests, then MT-Bench first turns."""
    from experiments import data

    out = [("humaneval", i, t) for i, t in enumerate(data.humaneval_messages(num_humaneval))] if num_humaneval else []
    out += [("mtbench", i, t) for i, t in enumerate(data.mtbench_questions(num_mtbench))] if num_mtbench else []
    return out


def key(line: dict) -> tuple:
    """A measurement's identity in the ledger: one output directory may hold several models' runs."""
    return line["model"], line["max_new_tokens"], line["dataset"], line["index"], line["config"]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Runner:
    """Engines built once each (lazily), measurements appended to the ledger as they are made."""

    def __init__(self, target, drafts: dict[str, Any], max_new_tokens: int, ledger: _jsonl.Ledger,
                 settings: dict[str, Any], log=print):
        self.target, self.drafts, self.new, self.ledger = target, drafts, max_new_tokens, ledger
        self.settings, self.log = settings, log
        self.engines: dict[str, specjax.Engine] = {}
        self.compiled: set[tuple[str, int]] = set()  # (config, prompt width)

    def engine(self, row: Row | None) -> specjax.Engine:
        from experiments import _rule_flags

        name = TARGET if row is None else row.label
        if name not in self.engines:
            if row is None:
                e = specjax.Engine(self.target, max_new_tokens=self.new, eos_ids=())
            else:
                method, options = _rule_flags.parse_method_spec(row.method)
                extra = {"adaptive": row.adaptive} if has_adaptive() else {}
                e = specjax.Engine(self.target, draft=self.drafts[row.draft], method=method, k=row.k,
                                   max_new_tokens=self.new, eos_ids=(), **extra, **options)
            self.engines[name] = e
        return self.engines[name]

    def measure(self, dataset: str, index: int, text: str, ids: list[int], row: Row | None,
                start=None) -> dict:
        """One timed generate; `start`: the adaptive policy's counts to begin from (an earlier line's)."""
        name = TARGET if row is None else row.label
        engine = self.engine(row)
        if (name, engine.prompt_width([ids])) not in self.compiled:  # untimed (from disk when compiled before)
            engine.lower([ids]).compile()
            if row is not None and row.adaptive:
                engine.cost_table(1)  # measured once per configuration (or read from disk): not in the timing
            self.compiled.add((name, engine.prompt_width([ids])))
        extra = {"adaptation": start} if start is not None else {}
        began = time.perf_counter()
        out = engine.generate([ids], **extra)
        seconds = time.perf_counter() - began
        s = out.stats
        line = dict(dataset=dataset, index=index, config=name, prompt_sha=_sha(text), prompt_tokens=len(ids),
                    tokens=len(out.tokens[0]), seconds=seconds, tokens_per_s=len(out.tokens[0]) / seconds,
                    tau=s.get("tau"), rounds=s.get("rounds"),
                    accepted_counts=s.get("accepted_counts_per_position"),
                    offered=s.get("offered_per_position"), widths=s.get("widths"),
                    output_sha=_sha(",".join(map(str, out.tokens[0]))), **self.settings,
                    date=datetime.date.today().isoformat())
        if row is not None:
            line.update(method=row.method, draft=row.draft, k=row.k, adaptive=row.adaptive)
        if row is not None and row.adaptive and carries_adaptation():  # what the next prompt starts from
            line.update(warm_start=start is not None, adaptation={
                "hits": np.asarray(out.adaptation.hits_LK).tolist(),
                "trials": np.asarray(out.adaptation.trials_LK).tolist()})
        self.ledger.append(line)
        return line

    def run(self, items: Sequence[tuple[str, int, str]], all_rows: Sequence[Row]) -> int:
        """Measures whatever the ledger lacks, prompt by prompt; the number of new measurements.

        An adaptive row starts each prompt from the counts its previous prompt of the same data set
        left (read from the ledger, so a resumed run starts where an unbroken one would), as a
        server's stream of requests would; the first prompt of a data set starts from none."""
        done = 0
        for n, (dataset, index, text) in enumerate(items):
            ids = self.target.tokenizer.chat_prompt_ids(text)
            for row in [None, *all_rows]:
                old = self.ledger.get(key({**self.settings, "dataset": dataset, "index": index,
                                           "config": TARGET if row is None else row.label}))
                if old is not None:
                    if old["prompt_sha"] != _sha(text):
                        raise ValueError(f"{dataset} {index}: the ledger's prompt differs from this one "
                                         "(another version of the data set?): use another --output_dir")
                    continue
                start = None
                if row is not None and row.adaptive and index > 0:
                    start = _adaptation(self.ledger.get(key({**self.settings, "dataset": dataset,
                                                             "index": index - 1, "config": row.label})))
                line = self.measure(dataset, index, text, ids, row, start)
                done += 1
                self.log(f"prompt {n + 1}/{len(items)} ({dataset} {index}) {line['config']}: "
                         f"{line['tokens_per_s']:.1f} tokens/s, tau {line['tau']:.2f}")
        return done


# --- the table -----------------------------------------------------------------------------------

def summarize(lines: Sequence[dict], all_rows: Sequence[Row]) -> list[dict]:
    """Per row: median over prompts of tokens/s / target-only's on the same prompt, median tau,
    the acceptance counts summed; then per (method, draft): the best fixed K and the adaptive
    row's standing against it."""
    base = {(l["dataset"], l["index"]): l["tokens_per_s"] for l in lines if l["config"] == TARGET}
    out = []
    for row in all_rows:
        mine = [l for l in lines if l["config"] == row.label and (l["dataset"], l["index"]) in base]
        if not mine:
            continue
        ratios = [l["tokens_per_s"] / base[(l["dataset"], l["index"])] for l in mine]
        acc = np.sum([l["accepted_counts"] for l in mine if l.get("accepted_counts")], axis=0) if any(
            l.get("accepted_counts") for l in mine) else None
        widths = np.sum([l["widths"] for l in mine if l.get("widths")], axis=0) if any(
            l.get("widths") for l in mine) else None
        out.append(dict(row=row, prompts=len(mine), ratio=statistics.median(ratios),
                        tau=statistics.median(l["tau"] for l in mine),
                        rounds=sum(l["rounds"] for l in mine),
                        accepted_counts=None if acc is None else acc.tolist(),
                        widths=None if widths is None else widths.tolist()))
    for group in dict.fromkeys(s["row"].group for s in out):
        fixed = [s for s in out if s["row"].group == group and not s["row"].adaptive]
        best = max(fixed, key=lambda s: s["ratio"]) if fixed else None
        for s in out:
            if s["row"].group == group:
                s["best_fixed_k"] = None if best is None else best["row"].k
                s["best_fixed_ratio"] = None if best is None else best["ratio"]
                if s["row"].adaptive and best is not None:
                    s["within_5pct"] = s["ratio"] >= 0.95 * best["ratio"]
                    s["at_least_1x"] = s["ratio"] >= 1.0
    return out


def expected_tokens(accepted_counts: Sequence[float], rounds: int, width: int) -> float:
    """Tokens per round had every round verified only `width` positions (width - 1 drafts): 1 plus
    the rounds in which each of the first width - 1 positions was accepted, per round. From a run
    at a larger K, whose accepted prefix a narrower verify would have cut at width - 1."""
    return 1.0 + float(np.sum(np.asarray(accepted_counts, float)[: width - 1])) / max(rounds, 1)


def chosen_width(accepted_counts, rounds: int, costs, widths: Sequence[int]) -> tuple[int, float]:
    """(the width with the most expected tokens per second under `costs`, its expected speedup
    over target-only): the adaptive policy's choice (`loop.choose_width`) with the acceptance a
    row showed, held fixed over the run. `costs`: a `CostTable` (verify_s per width, draft_step_s)."""
    step = costs.verify_s[0]
    best = (1, 1.0)
    for w in widths:
        seconds = costs.verify_s[w - 1] + costs.draft_step_s * (w - 1)
        speedup = expected_tokens(accepted_counts, rounds, w) / seconds * step
        if speedup > best[1] + 1e-12:
            best = (w, speedup)
    return best


_SECTION = re.compile(r"^(\S+) \(random weights\), batch (\d+), (\d+) new tokens, K=(\d+)$")


def h200_profile(path: os.PathLike = H200_PROFILE) -> dict[str, dict]:
    """{model: {"k": K, "rows": {config: (tokens/s, tau)}}} of the file's batch-1 tables."""
    out, current = {}, None
    for line in pathlib.Path(path).read_text().splitlines():
        m = _SECTION.match(line.strip())
        if m:
            current = None
            if m.group(2) == "1":
                current = out.setdefault(m.group(1), {"k": int(m.group(4)), "rows": {}})
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is not None and line.startswith("|") and len(cells) == 4 and cells[1][:1].isdigit():
            current["rows"][cells[0]] = (float(cells[1]), float(cells[3]))
    return out


def h200_costs(model_name: str, k: int, model_draft: bool, path: os.PathLike = H200_PROFILE):
    """A `CostTable` for widths 1 .. k + 1 computed from the H200 profile's batch-1 rounds of
    `model_name` (its preset name, e.g. "qwen2.5-coder-1.5b-instruct"): a target step is one
    target-only token; a round of exact/pld at the file's K (tau / tokens/s) is a verify of width
    K + 1 (prompt lookup's search costs next to nothing there), linear in the width between; a
    draft-model step is (a model-drafted round - that verify) / K. None when the file has no
    table for the model."""
    profile = h200_profile(path)
    name = next((m for m in profile if model_name.startswith(m)), None)
    if name is None or TARGET not in profile[name]["rows"] or "exact/pld" not in profile[name]["rows"]:
        return None
    rows, K = profile[name]["rows"], profile[name]["k"]
    step = 1.0 / rows[TARGET][0]
    verify = rows["exact/pld"][1] / rows["exact/pld"][0] / step  # target steps of a K + 1 wide round
    draft_ratio = 0.0
    drafted = next((v for c, v in rows.items() if c.startswith("exact/draft")), None)
    if model_draft and drafted is not None:
        draft_ratio = max(drafted[1] / drafted[0] / step - verify, 0.0) / K
    ratios = [1.0 + (verify - 1.0) * (w - 1) / K for w in range(1, k + 2)]  # linear through widths 1, K + 1
    return cost_table(verify_s=tuple(step * r for r in ratios), draft_step_s=step * draft_ratio,
                      platform="H200 (gpu)",
                      source=f"computed from the H200 profile ({pathlib.Path(path).name}, {name}, batch 1, K={K})")


@dataclasses.dataclass(frozen=True)
class _Costs:
    """`specjax.costs.CostTable`'s fields, where this specjax has none (before the adaptive loop)."""

    verify_s: tuple[float, ...]
    draft_step_s: float = 0.0
    platform: str = ""
    source: str = ""


def cost_table(**fields):
    try:
        from specjax.costs import CostTable
    except ImportError:
        return _Costs(**fields)
    return CostTable(**fields)


def empty_round_cost(target, ids: list[int], k: int, max_new_tokens: int, repeats: int = 5) -> dict | None:
    """Seconds per token of the adaptive loop made to verify width 1 every round (a cost table
    where any wider verify costs 10^6 s: nothing is proposed to the target), over target-only's;
    medians of `repeats` interleaved runs. None where this specjax has no adaptive loop."""
    if not has_adaptive():
        return None
    table = cost_table(verify_s=(1.0,) + (1e6,) * k, draft_step_s=0.0, platform="any",
                       source="every width but 1 made dear")
    lone = specjax.Engine(target, draft="pld", method="exact", k=k, max_new_tokens=max_new_tokens, eos_ids=(),
                          adaptive=True, costs=table)
    base = specjax.Engine(target, max_new_tokens=max_new_tokens, eos_ids=())
    times = {"lone": [], "base": []}
    for e in (lone, base):
        e.lower([ids]).compile()
    out = None
    for _ in range(repeats):
        for name, e in (("base", base), ("lone", lone)):
            start = time.perf_counter()
            out = e.generate([ids])
            times[name].append(time.perf_counter() - start)
            if name == "lone":
                widths = out.stats.get("widths") or []
                if len(widths) > 2 and sum(widths[2:]) > 0:
                    raise RuntimeError(f"the width-1 cost table still verified wider rounds: widths {widths}")
    return dict(steps=statistics.median(times["lone"]) / statistics.median(times["base"]),
                lone_s=statistics.median(times["lone"]), base_s=statistics.median(times["base"]),
                tokens=max_new_tokens, repeats=repeats, k=k)


def policy_widths(k: int) -> tuple[int, ...]:
    """The widths the adaptive loop compiles and chooses among (`loop.adaptive_widths`), or every
    width 1 .. k + 1 where this specjax has no adaptive loop."""
    from specjax import loop

    return tuple(loop.adaptive_widths(k)) if hasattr(loop, "adaptive_widths") else tuple(range(1, k + 2))


# --- the report ----------------------------------------------------------------------------------

def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def table(summary: Sequence[dict], h200, model_draft_names: Sequence[str] = ()) -> str:
    """One markdown table: a line per row (see `summarize`), with the width the policy would
    choose under `h200` (a function (k, model_draft) -> CostTable or None) from the row's
    measured acceptance (fixed-K rows; an adaptive row's rounds were cut by its own choices)."""
    head = ("| rule | drafter | K | loop | prompts | tokens/s vs target-only (median) | tau (median) | best fixed K "
            "| adaptive within 5% of it | adaptive >= 1.0x | widths chosen here (width: rounds) "
            "| H200 profile: width chosen (expected x) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summary:
        r = s["row"]
        h200_cell = "-"
        if not r.adaptive and s["accepted_counts"] is not None:
            costs = h200(r.k, r.draft in model_draft_names)
            if costs is not None:
                w, x = chosen_width(s["accepted_counts"], s["rounds"], costs, policy_widths(r.k))
                h200_cell = f"{w} ({x:.2f}x)"
        widths = "-"
        if s["widths"]:
            widths = ", ".join(f"{w}: {n}" for w, n in enumerate(s["widths"]) if n)
        best = "-" if s["best_fixed_k"] is None else f"{s['best_fixed_k']} ({s['best_fixed_ratio']:.2f}x)"
        yes = {True: "yes", False: "**no**", None: "-"}
        lines.append(f"| {METHOD_LABELS.get(r.method, r.method)} | {r.draft} | {r.k} | "
                     f"{'adaptive' if r.adaptive else 'fixed'} | {s['prompts']} | {s['ratio']:.2f}x | {s['tau']:.2f} "
                     f"| {best} | {yes[s.get('within_5pct')]} | {yes[s.get('at_least_1x')]} | {widths} | {h200_cell} |")
    return "\n".join(lines)
