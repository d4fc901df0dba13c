r"""Drafts of another family against their yardsticks: tau and tokens/s per prompt, resumable.

For each target (--targets) and each prompt (HumanEval chat requests, then MT-Bench first turns), at
each K (--ks) and rule (--methods), greedy, fixed K (`adaptive=False`, so tau is the drafts' and not
the width policy's), batch 1:

    cross          specjax's on-device translation: Engine(target, draft=--cross_draft), the draft
                   reading the request rendered by its own chat template (draft_prompts=)
    host           FLy's way: the text re-tokenized on the host every round (experiments/_cross_vocab_host.py)
    transformers   transformers' assisted generation with assistant_tokenizer= (exact only; --transformers)
    same           a draft of the target's own family (--same_draft; not when it is the target)
    pld            prompt lookup

and target-only decoding first. A call that compiled a program is made again and timed the second
time (greedy: the same tokens). Every measurement is a line of OUTPUT_DIR/measurements.jsonl, written as
it is made: the same command resumes. The table (printed, and OUTPUT_DIR/table.md) gives per target, K
and rule: tau over all prompts (tokens from verifications / verifications, summed over prompts, for
every drafter), the median over prompts of tokens/s over target-only's, exact's outputs equal to
target-only's, and the on-device tau over the best of host and transformers on the prompts both have
(the goal: >= 0.9).

    python experiments/cross_vocab_table.py --output_dir experiments/results/cross_vocab_table
    python experiments/cross_vocab_table.py --num_humaneval 2 --num_mtbench 2 --ks 8 --max_new_tokens 32 \
        --targets qwen2.5-coder-0.5b-instruct --notransformers --output_dir /tmp/cross_small
"""

from __future__ import annotations

import datetime
import os
import time

from absl import flags, logging

from experiments import _cli, _jsonl, _paths
from experiments._cross_vocab_rows import DRAFTERS, command, sha, configs, key, label, prompts, table, where

_TARGETS = flags.DEFINE_list("targets", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"], "Targets.")
_CROSS = flags.DEFINE_string("cross_draft", "smollm2-135m-instruct", "The draft of another family.")
_SAME = flags.DEFINE_string("same_draft", "qwen2.5-coder-0.5b-instruct", "The draft of the targets' family.")
_KS = flags.DEFINE_list("ks", ["8", "15"], "Draft lengths.")
_METHODS = flags.DEFINE_list("methods", ["exact", "fly"], "Rules (specjax method names).")
_NUM_HE = flags.DEFINE_integer("num_humaneval", 40, "HumanEval chat requests (the first N).")
_NUM_MT = flags.DEFINE_integer("num_mtbench", 40, "MT-Bench first turns (the first N).")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens at most per prompt (each model's EOS ends a reply).")
_TRANSFORMERS = flags.DEFINE_boolean("transformers", True, "Also run transformers' assisted generation (exact).")
_DRAFTERS = flags.DEFINE_list("drafters", ["cross", "host", "same", "pld"], "The specjax-side drafters to run "
                              "(a subset for a quick look; the table's rows need all four).")
_OUT = flags.DEFINE_string("output_dir", None, "Where measurements.jsonl (resumed) and table.md go.")
flags.mark_flag_as_required("output_dir")

class Runner:
    """The specjax side: models, engines and the host reference built once per target, lines appended."""

    def __init__(self, target_name: str, ledger: _jsonl.Ledger, settings: dict):
        import specjax
        from specjax import loop
        from experiments import _models
        from experiments._cross_vocab_host import HostReference

        self.specjax, self.loop, self.HostReference = specjax, loop, HostReference
        self.ledger, self.settings, self.new = ledger, settings, settings["max_new_tokens"]
        self.target = _models.load_model(target_name)
        self.cross = _models.load_model(_CROSS.value)
        self.same = None if _SAME.value == target_name else _models.draft_model(_SAME.value, self.target)
        self.engines: dict[str, object] = {}

    def engine(self, drafter: str | None, method: str = "exact", k: int = 0):
        name = "target-only" if drafter is None else label(drafter, method, k)
        if name not in self.engines:
            spec = {None: None, "cross": self.cross, "same": self.same, "pld": "pld", "host": "pld"}[drafter]
            if spec is None:
                e = self.specjax.Engine(self.target, max_new_tokens=self.new)
            else:
                e = self.specjax.Engine(self.target, draft=spec, method=method, k=k, adaptive=False,
                                        max_new_tokens=self.new)
            self.engines[name] = self.HostReference(e, self.cross, k) if drafter == "host" else e
        return self.engines[name]

    def measure(self, dataset, index, text, drafter, method, k, base_sha) -> dict:
        ids = self.target.tokenizer.chat_prompt_ids(text)
        own = self.cross.tokenizer.chat_prompt_ids(text)  # the draft's own rendering of the request
        engine = self.engine(drafter, method, k)
        if drafter == "host":
            (tokens, rounds), seconds = _timed(engine.compiled, lambda: engine.generate(ids, own, self.new))
            tau = (len(tokens) - 1) / max(rounds, 1)
        else:
            kwargs = {"draft_prompts": [own]} if drafter == "cross" else {}
            out, seconds = _timed(self.loop.Program.run._cache_size,
                                  lambda: engine.generate([ids], **kwargs))
            tokens, rounds, tau = out.tokens[0], out.stats.get("rounds", 0), out.stats.get("tau", 1.0)
        line = dict(self.settings, dataset=dataset, index=index, prompt_sha=sha(text),
                    config="target-only" if drafter is None else label(drafter, method, k),
                    drafter=drafter or "none", method=method, k=k, tokens=len(tokens), rounds=rounds, tau=tau,
                    seconds=seconds, tokens_per_s=len(tokens) / seconds,
                    output_sha=sha(",".join(map(str, tokens))), date=datetime.date.today().isoformat())
        if base_sha is not None:
            line["equals_target_only"] = line["output_sha"] == base_sha
        self.ledger.append(line)
        return line


def _timed(compiled, call):
    """(call's result, its seconds), timed without compilation: `compiled()` counts the programs
    traced so far; a call that traced one (compiled, or read the disk cache) is made again, timed.
    Greedy decoding makes the same tokens both times."""
    before = compiled()
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    if compiled() != before:
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
    return result, seconds


def run_specjax(target_name, items, ledger, settings) -> None:
    runner = None
    todo = [c for c in configs([int(k) for k in _KS.value], _METHODS.value, target_name, _SAME.value)
            if c[0] in _DRAFTERS.value]
    for n, (dataset, index, text) in enumerate(items):
        base = ledger.get(key({**settings, "dataset": dataset, "index": index, "config": "target-only"}))
        for drafter, method, k in [(None, "exact", 0), *todo]:
            name = "target-only" if drafter is None else label(drafter, method, k)
            old = ledger.get(key({**settings, "dataset": dataset, "index": index, "config": name}))
            if old is not None:
                if old["prompt_sha"] != sha(text):
                    raise _paths.RunError(f"{dataset} {index}: the ledger's prompt differs (another data set "
                                          "version?): use another --output_dir")
                continue
            runner = runner or Runner(target_name, ledger, settings)
            line = runner.measure(dataset, index, text, drafter, method, k, None if base is None else base["output_sha"])
            if drafter is None:
                base = line
            _cli.log(f"{target_name} prompt {n + 1}/{len(items)} ({dataset} {index}) {name}: "
                     f"tau {line['tau']:.2f}, {line['tokens_per_s']:.1f} tokens/s")


def run_transformers(target_name, items, ledger, settings) -> None:
    from specjax.models import presets
    from experiments._cross_vocab_host import transformers_tau

    for k in (int(k) for k in _KS.value):
        name = label("transformers", "exact", k)
        missing = [(d, i, t) for d, i, t in items
                   if ledger.get(key({**settings, "dataset": d, "index": i, "config": name})) is None]
        if not missing:
            continue
        from specjax.models.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(presets.resolve(target_name))
        peer = transformers_tau(presets.resolve(target_name), presets.resolve(_CROSS.value), k,
                                settings["max_new_tokens"])
        for dataset, index, text in missing:
            try:
                tokens, tau = peer(tok.chat_prompt_ids(text))
            except RuntimeError as e:  # not recorded: a rerun tries the prompt again
                _cli.log(f"{target_name} ({dataset} {index}) {name}: transformers failed: {str(e)[:200]}")
                continue
            base = ledger.get(key({**settings, "dataset": dataset, "index": index, "config": "target-only"}))
            line = dict(settings, dataset=dataset, index=index, prompt_sha=sha(text), config=name,
                        drafter="transformers", method="exact", k=k, tokens=len(tokens), tau=tau,
                        output_sha=sha(",".join(map(str, tokens))), date=datetime.date.today().isoformat())
            if base is not None:  # transformers stops at its generation config's EOS ids: compared, not assumed
                line["equals_target_only"] = line["output_sha"] == base["output_sha"]
            ledger.append(line)
            _cli.log(f"{target_name} ({dataset} {index}) {name}: tau {tau:.2f}")


def _command(lines, shown) -> str:
    names = ("targets", "cross_draft", "same_draft", "ks", "methods", "max_new_tokens", "num_humaneval",
             "num_mtbench")
    F = flags.FLAGS
    flat = lambda v: ",".join(v) if isinstance(v, list) else v
    values = {n: flat(F[n].value) for n in names} | {"targets": ",".join(shown)}
    return command(lines, values, {n: flat(F[n].default) for n in names}, _OUT.value)


def main(argv):
    if len(argv) > 1:
        raise _paths.RunError(f"unexpected arguments: {' '.join(argv[1:])}")
    _paths.check_output("output_dir", _OUT.value, dir=True)
    logging.set_verbosity(logging.WARNING)
    try:
        ks = [int(k) for k in _KS.value]
    except ValueError:
        raise _paths.RunError(f"--ks must be integers, got {_KS.value}") from None
    if not ks or min(ks) < 1 or _NEW.value < 2 or min(_NUM_HE.value, _NUM_MT.value) < 0:
        raise _paths.RunError("--ks must be integers >= 1, --max_new_tokens >= 2, prompt counts >= 0")
    unknown = sorted(set(_DRAFTERS.value) - {"cross", "host", "same", "pld"})
    if unknown:
        raise _paths.RunError(f"--drafters: unknown {', '.join(unknown)} (cross, host, same, pld)")
    items = prompts(_NUM_HE.value, _NUM_MT.value)
    os.makedirs(_OUT.value, exist_ok=True)
    ledger = _jsonl.Ledger(os.path.join(_OUT.value, "measurements.jsonl"), key)
    _paths.set_status(lambda: f"{len(ledger)} measurements in {ledger.path}; the same command resumes")
    for target in _TARGETS.value:
        settings = dict(target=target, cross_draft=_CROSS.value, max_new_tokens=_NEW.value, machine=_cli.machine())
        run_specjax(target, items, ledger, settings)
        if _TRANSFORMERS.value:
            run_transformers(target, items, ledger, settings)
    ledger.close()
    lines = list(ledger.lines.values())
    shown = list(dict.fromkeys([*(l["target"] for l in lines), *_TARGETS.value]))  # every target measured here
    parts = [f"# Drafts of another family: {_CROSS.value} for {', '.join(shown)}", "",
             "Measured (and resumed, from the ledger beside this file) with:", "",
             f"    {_command(lines, shown)}", "",
             f"Up to {_NEW.value} new tokens, greedy, fixed K, batch 1. tau: tokens from verifications / the "
             "target's verifications, each summed over the prompts (specjax: its rounds; transformers: its "
             "forward calls, the first of which also verifies). A prompt's rows ran on one machine, one after "
             "another, so its tokens/s ratios compare like with like."]
    for target in shown:
        parts += ["", f"## {target}", "", f"Measured on {where(lines, target)}.", "", table(lines, target)]
    text = "\n".join(parts) + "\n"
    print(text)
    _paths.write_text(os.path.join(_OUT.value, "table.md"), text)


if __name__ == "__main__":
    _paths.run(main)
