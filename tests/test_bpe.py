"""specjax.bpe: the destination's byte-level BPE on the device, against `tokenizers`' own encoding
(the real reference), the plain host reference `encode_host`, and the host simulation
`experiments._cross_vocab.bpe_in_pieces` (the same piece cuts)."""

from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, models, pre_tokenizers as pt, trainers

from _tokenizer_corpus import CODE, DIGITS, EMOJI, PROSE, UNICODE, WHITESPACE
from experiments import _cross_vocab as ref
from specjax import bpe, pretokenize, vocab_bridge as vb
from specjax.models.tokenizer import Tokenizer

TRAIN = CODE + PROSE + UNICODE + EMOJI + DIGITS + WHITESPACE
KINDS = ["qwen2", "gpt2", "gpt2-digits"]
S, CAP = 512, 256  # buffer slots, output ids


def _pre(kind):
    byte_level = lambda regex: pt.ByteLevel(add_prefix_space=False, use_regex=regex)
    return {"qwen2": pt.Sequence([pt.Split(Regex(pretokenize.QWEN2_PATTERN), behavior="isolated"), byte_level(False)]),
            "gpt2": byte_level(True),
            "gpt2-digits": pt.Sequence([pt.Digits(individual_digits=True), byte_level(True)])}[kind]


@functools.lru_cache(maxsize=None)
def _tok(kind, vocab_size=600, lacking=b""):
    """A byte-level BPE trained on the corpus with the pre-tokenizer `kind` (specials first)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = _pre(kind)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[AddedToken("<|im_end|>", special=True)],
                                  initial_alphabet=[c for c in pt.ByteLevel.alphabet()
                                                    if vb.byte_decoder()[c] not in lacking], show_progress=False)
    backend.train_from_iterator(TRAIN * 3, trainer)
    tok = Tokenizer(backend, vocab_size=backend.get_vocab_size(with_added_tokens=True), bos_token_id=None,
                    eos_token_id=backend.token_to_id("<|im_end|>"))
    assert pretokenize.kind_of(tok) == kind
    return tok


@functools.lru_cache(maxsize=None)
def _device(kind, piece_cap=64, chunk=128):
    tok = _tok(kind)
    tables = bpe.merge_tables(tok)
    dev = {k: jnp.asarray(v) for k, v in tables.items()}
    steps = bpe.search_steps(tables["merge_start_V1"])
    cls = jnp.asarray(pretokenize.char_classes())
    fn = jax.jit(lambda buf, total: bpe.encode(buf, total, CAP, dev, steps=steps, pieces=kind, class_U=cls,
                                               piece_cap=piece_cap, chunk=chunk))
    return tok, tables, fn


def _encode(kind, values, *, piece_cap=64, chunk=128, total=None):
    """bpe.encode of a list of slot values (bytes, or 256 + id for a special) -> (ids, end)."""
    tok, _, fn = _device(kind, piece_cap, chunk)
    buf = np.full(S + bpe.buffer_padding(piece_cap, chunk), -1, np.int32)
    buf[:len(values)] = values
    out, count, end = fn(jnp.asarray(buf), jnp.int32(len(values) if total is None else total))
    return [int(t) for t in np.asarray(out)[:int(count)]], int(end)


def _texts(seed=0, n=60):
    rng = random.Random(seed)
    chars = "abcAB xyz_(){}:=\n\r\t '0123456789é中文🙂ß→.,;-sSdD"
    out = [t for t in TRAIN if len(t.encode()) <= S]
    out += ["".join(rng.choice(chars) for _ in range(rng.randint(1, 120))) for _ in range(n)]
    out += ["aaaaaaaaa", "    " * 9 + "x", "\n" + " " * 40 + "return 0", "ababababab", "1234567890" * 3]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_tokenizer_on_random_texts(kind):
    """Token for token what `tokenizers` encodes (its pre-tokenizer and merges, no normalizer), and
    what the plain reference encodes; pieces up to the cap (64 bytes)."""
    tok = _tok(kind)
    for text in _texts():
        data = text.encode()
        got, end = _encode(kind, list(data))
        assert end == len(data)
        assert got == ref.bpe_in_pieces(tok, data), repr(text)
        if max(pretokenize.pieces_host(data, kind), default=0) <= 64:
            assert got == vb.encode_bytes(tok, data), repr(text)


def test_ties_merge_leftmost_first():
    """A repeated pair merges leftmost first: "aaa" is (aa)(a), not (a)(aa), as `tokenizers` does."""
    tables = dict(byte_tok_256=np.arange(256, dtype=np.int32), merge_start_V1=np.zeros(259, np.int32))
    # one merge: (a, a) -> 256; and (256, a) -> 257 never exists, so "aaa" stays (aa)(a)
    a = ord("a")
    tables["merge_start_V1"][a + 1:] = 1
    tables.update(merge_right_M=np.asarray([a], np.int32), merge_rank_M=np.asarray([0], np.int32),
                  merge_id_M=np.asarray([256], np.int32))
    dev = {k: jnp.asarray(v) for k, v in tables.items()}
    for n, want in ((3, [256, a]), (4, [256, 256]), (5, [256, 256, a]), (1, [a])):
        buf = jnp.asarray([a] * n + [-1] * (128 + 36), jnp.int32)
        out, count, end = bpe.encode(buf, jnp.int32(n), 8, dev, steps=1, piece_cap=32, chunk=128)
        assert [int(t) for t in out[:int(count)]] == want == bpe.encode_host(tables, [a] * n)
        assert int(end) == n


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_chunks_and_long_pieces(kind):
    """Texts longer than a chunk, cut at piece boundaries; a piece longer than the cap is cut there,
    as the host simulation cuts it."""
    tok = _tok(kind)
    text = "".join(CODE)[:S].encode()
    for chunk, cap in ((32, 16), (64, 32), (128, 64)):
        got, end = _encode(kind, list(text), piece_cap=cap, chunk=chunk)
        assert got == ref.bpe_in_pieces(tok, text, max_piece=cap) and end == len(text)
    spaces = b"x" + b" " * 100 + b"y"
    got, _ = _encode(kind, list(spaces), piece_cap=32, chunk=64)
    assert got == ref.bpe_in_pieces(tok, spaces, max_piece=32)
    assert b"".join(vb.token_bytes(tok)[t] for t in got) == spaces


def test_cap_cuts_at_a_token_and_reports_its_byte_end():
    kind = "gpt2"
    tok = _tok(kind)
    data = "def add(a, b):\n    return a + b\n".encode()
    whole = vb.encode_bytes(tok, data)
    tables, steps, cls = _device_tables(kind), _steps(kind), jnp.asarray(pretokenize.char_classes())
    buf = np.full(S + 128 + 68, -1, np.int32)
    buf[:len(data)] = list(data)
    for cap in (1, 3, len(whole) - 1, len(whole), len(whole) + 5):
        f = jax.jit(lambda b, t, cap=cap: bpe.encode(b, t, cap, tables, steps=steps, pieces=kind, class_U=cls))
        out, count, end = f(jnp.asarray(buf), jnp.int32(len(data)))
        got = [int(t) for t in out[:int(count)]]
        assert got == whole[:cap]
        assert int(end) == sum(len(vb.token_bytes(tok)[t]) for t in got)
        assert np.all(np.asarray(out)[int(count):] == 0)


@functools.lru_cache(maxsize=None)
def _device_tables(kind):
    return {k: jnp.asarray(v) for k, v in bpe.merge_tables(_tok(kind)).items()}


def _steps(kind):
    return bpe.search_steps(bpe.merge_tables(_tok(kind))["merge_start_V1"])


def test_special_slots_are_their_own_tokens():
    """A special token (256 + id) is emitted as it is, never merged, and ends the piece before it."""
    kind = "qwen2"
    tok = _tok(kind)
    sid = tok.eos_token_id
    parts = [b"hello world", b" again\n", b"x"]
    values = list(parts[0]) + [256 + sid] + list(parts[1]) + [256 + sid, 256 + sid] + list(parts[2])
    got, end = _encode(kind, values)
    want = vb.encode_bytes(tok, parts[0]) + [sid] + vb.encode_bytes(tok, parts[1]) + [sid, sid] + \
        vb.encode_bytes(tok, parts[2])
    assert got == want and end == len(values)


def test_stops_at_total_and_ignores_what_follows():
    kind = "gpt2"
    tok = _tok(kind)
    data = b"return value + 1"
    got, end = _encode(kind, list(data) + list(b" ignored"), total=len(data))
    assert got == vb.encode_bytes(tok, data) and end == len(data)
    got, end = _encode(kind, list(data), total=0)
    assert got == [] and end == 0


def test_vmap_ragged_rows():
    kind = "gpt2-digits"
    tok = _tok(kind)
    texts = [b"x = 12345", b"", b"def f():\n    pass\n", "中文 🙂 é".encode()]
    rows = np.full((len(texts), 64 + bpe.buffer_padding(32, 128)), -1, np.int32)
    for i, t in enumerate(texts):
        rows[i, :len(t)] = list(t)
    tables, steps, cls = _device_tables(kind), _steps(kind), jnp.asarray(pretokenize.char_classes())
    fn = jax.jit(jax.vmap(lambda b, t: bpe.encode(b, t, 32, tables, steps=steps, pieces=kind, class_U=cls)))
    out, count, end = fn(jnp.asarray(rows), jnp.asarray([len(t) for t in texts], jnp.int32))
    for i, t in enumerate(texts):
        assert [int(x) for x in out[i, :int(count[i])]] == vb.encode_bytes(tok, t)
        assert int(end[i]) == len(t)


def test_merge_tables_keep_the_first_rank_and_skip_unknown_results():
    tok = _tok("gpt2")
    tables = bpe.merge_tables(tok)
    start, right = tables["merge_start_V1"], tables["merge_right_M"]
    assert start[0] == 0 and start[-1] == right.shape[0] and np.all(np.diff(start) >= 0)
    for a in range(tok.vocab_size):  # each row sorted by right id, no pair twice
        row = right[start[a]:start[a + 1]]
        assert np.all(np.diff(row) > 0)
    # every merge's result spells its two parts
    tb = vb.token_bytes(tok)
    left = np.repeat(np.arange(tok.vocab_size), np.diff(start))
    for a, b, c in zip(left, right, tables["merge_id_M"]):
        assert tb[a] + tb[b] == tb[c]
    assert sorted(tables["merge_rank_M"].tolist()) == list(range(len(tables["merge_rank_M"])))
    lacking = _tok("gpt2", 400, b"\x04\xff")
    bt = bpe.merge_tables(lacking)["byte_tok_256"]
    assert bt[4] == bt[0xFF] == -1 and (bt >= 0).sum() == 254
