"""Host-side cross-vocabulary translation, FLy's way: decode to text, re-encode with the other tokenizer.

The yardstick for specjax.vocab_bridge's on-device tables. FLy's published code does this every
round on the host: the draft's tokens are decoded to text and the text encoded with the target's
tokenizer (and the committed target tokens back to draft ids). `retokenize` is that; with
`context`, the context and the new tokens are re-encoded together and the ids after the part that
re-encodes the same are returned (transformers' assisted generation with `assistant_tokenizer` does
the same with a look-behind window), so merges across the seam come out canonical.

Also here, for the measurement that chose the device algorithm (the binary
`experiments/cross_vocab_reference.py`; experiments/results/vocab_bridge.md): the host simulations of
`vocab_bridge`'s algorithms, each equal to its device function token for token (`bpe_in_pieces`: the
default "bpe"; `greedy_longest_match`: "greedy"), and `measure`, the agreement of each translation
with the target's own canonical encoding of the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from specjax import bpe, pretokenize, vocab_bridge




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


def greedy_longest_match(dst_tok, data: bytes, *, max_len: int = 32, pieces: str = "none") -> list[int]:
    """The longest vocabulary entry at each position, left to right (entries up to `max_len` bytes),
    within the pieces of the pre-tokenizer `pieces` (`specjax.pretokenize.KINDS`; each measured from
    its start in a window of max_len + 4 bytes and cut at max_len): what `vocab_bridge.resegment`
    computes on the device, written plainly."""
    table = _bytes_index(dst_tok, max_len)
    out, i, end = [], 0, 0
    while i < len(data):
        if i >= end:  # "none": one piece, the whole text
            end = len(data) if pieces == "none" else i + min(
                pretokenize.pieces_host(data[i: i + max_len + 4], pieces)[0], max_len)
        for k in range(min(max_len, end - i), 0, -1):
            tid = table.get(data[i:i + k])
            if tid is not None:
                out.append(tid)
                i += k
                break
        else:
            raise ValueError(f"byte {data[i]:#04x} is not in the vocabulary")
    return out


def bpe_in_pieces(dst_tok, data: bytes, *, max_piece: int = 64) -> list[int]:
    """The destination's merges (`bpe.encode_host`) in its pre-tokenizer's pieces, each cut at
    `max_piece` bytes: what `vocab_bridge.bpe_encode` computes on the device, written plainly (for
    pieces no longer than the cap, the tokenizer's own encoding of the bytes)."""
    key = ("bpe", id(dst_tok))
    if key not in _INDEX:
        _INDEX[key] = bpe.merge_tables(dst_tok)
    tables, kind = _INDEX[key], pretokenize.kind_of(dst_tok)
    out, i = [], 0
    while i < len(data):  # each piece measured from its start in a window, as the device does
        n = max_piece if kind == "none" else pretokenize.pieces_host(data[i:i + max_piece + 4], kind)[0]
        n = min(n, max_piece, len(data) - i)
        out += bpe.encode_host(tables, list(data[i:i + n]))
        i += n
    return out


_INDEX: dict = {}


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
        "greedy longest match, across pieces": lambda ids, data: greedy_longest_match(dst_tok, data),
        "greedy longest match in pieces":
            lambda ids, data: greedy_longest_match(dst_tok, data, pieces=pretokenize.kind_of(dst_tok)),
        "BPE merges in pieces (default)": lambda ids, data: bpe_in_pieces(dst_tok, data),
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


def cost(target_tok, draft_tok, *, batch: int = 8, repeats: int = 20) -> None:
    """Print each algorithm's host build time, table bytes and jitted device time per call
    (vmap over `batch` rows; K = 8 and 15; target -> draft of K + 1 tokens with cap 4(K + 1))."""
    import time

    import jax
    import jax.numpy as jnp

    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    d_ids, t_ids = draft_tok.encode(text), target_tok.encode(text)
    for algorithm in vocab_bridge.ALGORITHMS:
        start = time.perf_counter()
        bridge = vocab_bridge.build_bridge(target_tok, draft_tok, algorithm=algorithm)
        print(f"{algorithm}: build {time.perf_counter() - start:.1f} s, tables {bridge.nbytes / 2**20:.1f} MiB")
        for K in (8, 15):
            for name, fn, ids, n, cap in (("draft -> target", vocab_bridge.draft_to_target, d_ids, K, K),
                                          ("target -> draft", vocab_bridge.target_to_draft, t_ids, K + 1,
                                           4 * (K + 1))):
                ids_BxN = jnp.asarray([ids[i:i + n] for i in range(batch)], jnp.int32)
                n_B = jnp.full((batch,), n, jnp.int32)
                call = jax.jit(jax.vmap(lambda i, m, fn=fn, cap=cap: fn(bridge, i, m, cap)))
                jax.block_until_ready(call(ids_BxN, n_B))
                start = time.perf_counter()
                for _ in range(repeats):
                    out = call(ids_BxN, n_B)
                jax.block_until_ready(out)
                ms = (time.perf_counter() - start) / repeats * 1e3
                print(f"  K={K} {name} ({n} tokens, cap {cap}, batch {batch}): {ms:.2f} ms/call")


def _texts() -> dict[str, list[str]]:
    from experiments import data

    problems = data.humaneval_problems()
    return {"HumanEval prompts": [p["prompt"] for p in problems],
            "HumanEval prompt + solution": [p["prompt"] + p["canonical_solution"] for p in problems],
            "MT-Bench first turns": data.mtbench_questions()}


def speed(target_name: str, draft_name: str, *, prompts: int = 4, max_new_tokens: int = 96, k: int = 8,
          reps: int = 3, against: str | None = None) -> None:
    """Tokens/s of target-only decoding and of the cross-vocabulary draft (exact, greedy, batch 1), one
    engine after the other within each repetition (interleaved: the machine's load falls on all alike);
    medians per engine. `against`: a git revision whose specjax/cross_draft.py runs as a third engine
    (its drafter class in place of this one's), to measure a change of the drafter on the same load."""
    import importlib.util
    import subprocess
    import sys
    import tempfile
    import time

    import numpy as np

    import specjax
    from experiments import data
    from specjax import models

    target, draft = models.load(target_name), models.load(draft_name)
    texts = data.humaneval_messages(prompts // 2 + prompts % 2) + data.mtbench_questions(prompts // 2)
    rows = [target.tokenizer.chat_prompt_ids(t) for t in texts]
    engines = {"target-only": specjax.Engine(target, max_new_tokens=max_new_tokens),
               "cross exact": specjax.Engine(target, draft=draft, method="exact", k=k, max_new_tokens=max_new_tokens)}
    if against:
        source = subprocess.run(["git", "show", f"{against}:specjax/cross_draft.py"], capture_output=True,
                                text=True, check=True).stdout
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location("cross_draft_" + against.replace("/", "_"), f.name)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old
        spec.loader.exec_module(old)
        engine = specjax.Engine(target, draft=draft, method="exact", k=k, max_new_tokens=max_new_tokens)
        d = engine.drafter
        engine.drafter = old.CrossVocabDrafter(d.config, d.k, d.dtype, d.name, lookup=d.lookup)
        engines[f"cross exact @ {against}"] = engine
    outputs = {}
    for name, engine in engines.items():  # compile (and measure the adaptive costs) outside the timings
        start = time.perf_counter()
        outputs[name] = [engine.generate([p]) for p in rows]
        print(f"{name}: first pass {time.perf_counter() - start:.0f} s", flush=True)
    base = [o.tokens for o in outputs["target-only"]]
    for name, outs in outputs.items():
        assert [o.tokens for o in outs] == base, f"{name}: not target-only's tokens"
    rates: dict[str, list[float]] = {name: [] for name in engines}
    taus: dict[str, float] = {}
    for _ in range(reps):
        for name, engine in engines.items():
            tokens, start = 0, time.perf_counter()
            for p in rows:
                tokens += len(engine.generate([p]).tokens[0])
            rates[name].append(tokens / (time.perf_counter() - start))
            taus[name] = np.mean([o.stats.get("tau", 1.0) for o in outputs[name]])
    print(f"\n{len(rows)} prompts (HumanEval, MT-Bench chat), {max_new_tokens} new tokens, K = {k}, greedy, "
          f"batch 1, {reps} interleaved repetitions; outputs equal target-only's\n")
    print("| engine | tau | tokens/s (median) | per repetition |")
    print("|---|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {taus[name]:.2f} | {np.median(r):.2f} | {', '.join(f'{x:.2f}' for x in r)} |")
