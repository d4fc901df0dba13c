"""The vocabulary bridge measured against re-tokenizing on the host (experiments/results/vocab_bridge.md).

    python -m experiments.cross_vocab_reference            # agreement tables, about 2.5 minutes here
    python -m experiments.cross_vocab_reference --cost     # time the device translation
    python -m experiments.cross_vocab_reference --speed --speed_prompts=2 --max_new_tokens=48 --reps=2

The reference and the measurement live in experiments/_cross_vocab.py.
"""

from __future__ import annotations

import datetime
import platform

from absl import flags

from experiments import _common as C
from experiments._cross_vocab import _texts, cost, measure, speed

_DRAFT = flags.DEFINE_string("draft", "smollm2-135m-instruct", "Draft model preset (its tokenizer).")
_TARGET = flags.DEFINE_string("target", "qwen2.5-coder-0.5b-instruct", "Target model preset (its tokenizer).")
_COST = flags.DEFINE_boolean("cost", False, "Time the device translation instead.")
_SPEED = flags.DEFINE_boolean("speed", False, "Tokens/s of target-only and the cross draft (exact), interleaved.")
_SPEED_PROMPTS = flags.DEFINE_integer("speed_prompts", 4, "--speed: chat prompts, half HumanEval, half MT-Bench.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "--speed: new tokens per prompt.")
_REPS = flags.DEFINE_integer("reps", 3, "--speed: interleaved repetitions (medians reported).")
_AGAINST = flags.DEFINE_string("against", None, "--speed: a git revision whose cross_draft.py runs as a third engine.")


def main(argv) -> None:
    from specjax.models import presets
    from specjax.models.tokenizer import Tokenizer

    del argv
    args = flags.FLAGS
    if args.speed:
        speed(args.target, args.draft, prompts=args.speed_prompts, max_new_tokens=args.max_new_tokens,
              reps=args.reps, against=args.against)
        return
    toks = {role: Tokenizer.from_gguf(presets.resolve(name))
            for role, name in (("draft", args.draft), ("target", args.target))}
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}: "
          f"{args.draft} ({toks['draft'].vocab_size} ids) <-> {args.target} ({toks['target'].vocab_size} ids)\n")
    if args.cost:
        cost(toks["target"], toks["draft"])
        return
    for direction, src, dst in (("draft -> target", "draft", "target"), ("target -> draft", "target", "draft")):
        for corpus, texts in _texts().items():
            print(f"{direction}, {corpus} ({len(texts)} texts)\n")
            print("| algorithm | same position | same span | whole text equal | tokens / canonical |")
            print("|---|---|---|---|---|")
            for name, m in measure(toks[src], toks[dst], texts).items():
                print(f"| {name} | {m['same position']:.3f} | {m['same span']:.3f} | "
                      f"{m['whole text equal']:.3f} | {m['tokens / canonical']:.3f} |")
            print()


if __name__ == "__main__":
    C.run_main(main)
