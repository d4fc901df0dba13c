"""Host-side cross-vocabulary translation, FLy's way: decode to text, re-encode with the other tokenizer.

The yardstick for specjax.vocab_bridge's on-device tables. FLy's published code does this every
round on the host: the draft's tokens are decoded to text and the text encoded with the target's
tokenizer (and the committed target tokens back to draft ids). `retokenize` is that; with
`context`, the context and the new tokens are re-encoded together and the ids after the part that
re-encodes the same are returned (transformers' assisted generation with `assistant_tokenizer` does
the same with a look-behind window), so merges across the seam come out canonical.

Also here, for the measurement that chose the device algorithm (`python -m
experiments.cross_vocab_reference`; experiments/results/vocab_bridge.md): `greedy_longest_match`,
the host simulation of `vocab_bridge`'s default ("greedy", equal to it token for token), and
`measure`, the agreement of each translation with the target's own canonical encoding of the same
bytes.
"""

from __future__ import annotations

import argparse
import datetime
import platform
from collections.abc import Sequence

from specjax import vocab_bridge


def retokenize(src_tok, dst_tok, ids: Sequence[int], *, context: Sequence[int] = (),
               cap: int | None = None) -> list[int]:
    """`ids` of `src_tok` -> ids of `dst_tok`, through text (at most `cap` of them).

    Text, not bytes: a token that ends mid-character decodes to U+FFFD, so the bytes change there;
    special tokens are decoded to their text and re-encoded, so they map by text where both have them.
    """
    if context:
        before = dst_tok.encode(src_tok.decode(list(context)))
        both = dst_tok.encode(src_tok.decode(list(context) + list(ids)))
        same = 0
        while same < min(len(before), len(both)) and before[same] == both[same]:
            same += 1
        # the context's last tokens may re-merge with the new text: only what follows the common part
        out = both[same:]
    else:
        out = dst_tok.encode(src_tok.decode(list(ids)))
    return out if cap is None else out[:cap]


def greedy_longest_match(dst_tok, data: bytes, *, max_len: int = 32) -> list[int]:
    """The longest vocabulary entry at each position, left to right (entries up to `max_len` bytes):
    what a device re-segmentation through a sorted hash of byte prefixes would compute."""
    table = _bytes_index(dst_tok, max_len)
    out, i = [], 0
    while i < len(data):
        for k in range(min(max_len, len(data) - i), 0, -1):
            tid = table.get(data[i:i + k])
            if tid is not None:
                out.append(tid)
                i += k
                break
        else:
            raise ValueError(f"byte {data[i]:#04x} is not in the vocabulary")
    return out


_INDEX: dict[int, dict[bytes, int]] = {}


def _bytes_index(tok, max_len: int) -> dict[bytes, int]:
    key = id(tok) * 1000 + max_len
    if key not in _INDEX:
        index: dict[bytes, int] = {}
        for i, b in enumerate(vocab_bridge.token_bytes(tok)):
            if b and len(b) <= max_len and b not in index:
                index[b] = i
        _INDEX[key] = index
    return _INDEX[key]


def _agreement(got: list[int], want: list[int], got_bytes, want_bytes) -> tuple[int, int, int]:
    """(tokens equal at the same position, tokens equal with the same byte span, len(got))."""
    same_pos = sum(a == b for a, b in zip(got, want))
    spans, at = set(), 0
    for t in want:
        spans.add((at, t))
        at += len(want_bytes[t])
    same_span, at = 0, 0
    for t in got:
        same_span += (at, t) in spans
        at += len(got_bytes[t])
    return same_pos, same_span, len(got)


def measure(src_tok, dst_tok, texts: Sequence[str]) -> dict[str, dict[str, float]]:
    """For each algorithm: how the translation of `src_tok`'s encoding of each text agrees with
    `dst_tok`'s own encoding of the same bytes (per token at the same position, per token with the
    same byte span, whole text), plus translated tokens per canonical token."""
    table, lens = vocab_bridge.build_table(src_tok, dst_tok)
    dst_bytes = vocab_bridge.token_bytes(dst_tok)
    algos = {
        "per-token table": lambda ids, data: vocab_bridge.translate_host(ids, table, lens),
        "greedy longest match (default)": lambda ids, data: greedy_longest_match(dst_tok, data),
        "re-tokenize text (FLy, host)": lambda ids, data: retokenize(src_tok, dst_tok, ids),
    }
    sums = {name: [0, 0, 0, 0, 0] for name in algos}
    n_want = 0
    for text in texts:
        data = text.encode("utf-8")
        src = vocab_bridge.encode_bytes(src_tok, data)
        want = vocab_bridge.encode_bytes(dst_tok, data)
        n_want += len(want)
        for name, algo in algos.items():
            got = algo(src, data)
            pos, span, n = _agreement(got, want, dst_bytes, dst_bytes)
            s = sums[name]
            s[0] += pos; s[1] += span; s[2] += n; s[3] += got == want; s[4] += 1
    return {name: {"same position": s[0] / s[2], "same span": s[1] / s[2],
                   "whole text equal": s[3] / s[4], "tokens / canonical": s[2] / n_want}
            for name, s in sums.items()}


def _texts() -> dict[str, list[str]]:
    from experiments import data

    problems = data.humaneval_problems()
    return {"HumanEval prompts": [p["prompt"] for p in problems],
            "HumanEval prompt + solution": [p["prompt"] + p["canonical_solution"] for p in problems],
            "MT-Bench first turns": data.mtbench_questions()}


def main(argv: Sequence[str] | None = None) -> None:
    from specjax.models import presets
    from specjax.models.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", default="smollm2-135m-instruct")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    args = parser.parse_args(argv)
    toks = {role: Tokenizer.from_gguf(presets.resolve(name))
            for role, name in (("draft", args.draft), ("target", args.target))}
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}: "
          f"{args.draft} ({toks['draft'].vocab_size} ids) <-> {args.target} ({toks['target'].vocab_size} ids)\n")
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
    main()
