"""specjax.pretokenize: the pre-token pieces of byte-level BPE tokenizers, written out by hand, against
the real pre-tokenizers of `tokenizers` (plain reference) and the device form against the reference."""

from __future__ import annotations

import functools
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Regex, Tokenizer as Backend, decoders, models, pre_tokenizers as pt

from _tokenizer_corpus import CODE, DIGITS, EMOJI, PROSE, UNICODE, WHITESPACE
from specjax import pretokenize as P
from specjax.models.tokenizer import Tokenizer

KINDS = ["qwen2", "llama3", "gpt2", "gpt2-digits"]
W = 36  # the window vocab_bridge measures a piece in (match_len 32 + 4)


def _pre(kind):
    byte_level = lambda regex: pt.ByteLevel(add_prefix_space=False, use_regex=regex)
    return {"qwen2": pt.Sequence([pt.Split(Regex(P.QWEN2_PATTERN), behavior="isolated"), byte_level(False)]),
            "llama3": pt.Sequence([pt.Split(Regex(P.LLAMA3_PATTERN), behavior="isolated"), byte_level(False)]),
            "gpt2": byte_level(True),
            "gpt2-digits": pt.Sequence([pt.Digits(individual_digits=True), byte_level(True)])}[kind]


def _real(kind, text):
    return [len(text[a:b].encode()) for _, (a, b) in _pre(kind).pre_tokenize_str(text)]


def _texts(seed=0, n=300):
    rng = random.Random(seed)
    # contractions in both cases, curly quotes, no-break and ideographic spaces, \x0b, \x1c (Python's
    # isspace, not Unicode's White_Space), \x85, CRLF, digits runs, CJK, emoji, letters with marks
    chars = "abcAB xyz_(){}:=\n\r\t '0123456789é中文🙂ß→“”’\u00a0\u2003\u3000\x0b\x1c\x85.,;-sStTlLrReEvVdDmM"
    out = list(CODE + PROSE + UNICODE + EMOJI + DIGITS + WHITESPACE)
    out += ["".join(rng.choice(chars) for _ in range(rng.randint(1, 70))) for _ in range(n)]
    out += ["don't I'LL we've 'Re x'S 'd'm", "a  \n\n   b", "  (x", "\t(x", "((hello", " 123 4567 89012",
            "x\u00a0y", "x\u00a0\u00a0y", "\n    return x\n", "a\r\n\r\n  b", "x\u00a0 \u00a0"]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_reference_equals_the_real_pre_tokenizer(kind):
    for text in _texts():
        assert P.pieces_host(text.encode(), kind) == _real(kind, text), repr(text)


def _device_pieces(data: bytes, kind: str, specials=()) -> tuple[list[int], list[int]]:
    """Pieces by the device functions: piece_len at every position (vmapped), chained from 0."""
    n = len(data)
    size = -(-max(n, 1) // 128) * 128  # a few shapes, a few compilations
    buf = np.full(size + W, -1, np.int32)
    buf[:n] = list(data)
    for at, sid in specials:
        buf[at] = 256 + sid
    lens, cls = jax.device_get(_every(jnp.asarray(buf), kind))
    out, s = [], 0
    while s < n:
        out.append(int(lens[s]))
        s += out[-1]
    return out, [int(c) for c in cls[:n]]


@functools.partial(jax.jit, static_argnums=1)
def _every(buf_S, kind):
    cls_S = P.byte_classes(buf_S, jnp.asarray(P.char_classes()))
    win = lambda s: P.piece_len(jax.lax.dynamic_slice(buf_S, (s,), (W,)),
                                jax.lax.dynamic_slice(cls_S, (s,), (W,)), kind)
    return jax.vmap(win)(jnp.arange(buf_S.shape[0] - W)), cls_S


@pytest.mark.parametrize("kind", KINDS)
def test_device_equals_reference(kind):
    for text in _texts(seed=1, n=60):
        data = text.encode()
        got, cls = _device_pieces(data, kind)
        assert cls == P.byte_classes_host(data)
        want = P.pieces_host(data, kind)
        # a piece longer than the window is cut at its end there (the caller goes on from the cut)
        if max(want, default=0) < W - 4:
            assert got == want, repr(text)
        assert sum(got) == len(data) and min(got, default=1) >= 1


def test_bytes_that_are_not_utf8_and_specials():
    """Partial characters (a proposal cut inside one) and stray bytes count as OTHER on both sides;
    a special token is a piece of its own and ends the text before it (no space held back)."""
    data = "中".encode()[:2] + b"ab \x80\xff  " + "é".encode()[:1] + b"x"
    assert _device_pieces(data, "qwen2")[1] == P.byte_classes_host(data)
    assert P.byte_classes_host(data)[:2] == [P.OTHER, P.OTHER]
    for kind in KINDS:
        assert _device_pieces(data, kind)[0] == P.pieces_host(data, kind)
    # "x  " then a special: the run keeps both spaces (the text ends there), the special is 1
    got, cls = _device_pieces(b"x   y", "gpt2", specials=[(3, 7)])
    assert cls[3] == P.SPECIAL and got == [1, 2, 1, 1]


def test_awkward_sizes_and_empty():
    for kind in KINDS + ["none"]:
        assert P.pieces_host(b"", kind) == []
    assert P.pieces_host(b"ab cd", "none") == [5]
    long_word = b"a" * 100  # longer than the window: cut at it, never zero
    got, _ = _device_pieces(long_word, "qwen2")
    assert got[0] == W and sum(got) == 100
    with pytest.raises(ValueError, match="unknown pre-tokenizer kind 'bpe'"):
        P.pieces_host(b"x", "bpe")
    with pytest.raises(ValueError, match="unknown pre-tokenizer kind"):
        P.piece_len(jnp.zeros((W,), jnp.int32), jnp.zeros((W,), jnp.int32), "bpe")


def _tokenizer(pre):
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, vocab_size=1, bos_token_id=None, eos_token_id=None)


def test_kind_of_recognises_the_known_expressions_only():
    for kind in KINDS:
        assert P.kind_of(_tokenizer(_pre(kind))) == kind
    other = pt.Sequence([pt.Split(Regex(r"\s+|\S+"), behavior="isolated"), pt.ByteLevel(use_regex=False)])
    assert P.kind_of(_tokenizer(other)) == "none"
    assert P.kind_of(_tokenizer(pt.Whitespace())) == "none"
    assert P.kind_of(object()) == "none"
    # the patterns are the ones the real tokenizers serialize (Qwen2.5's GGUF holds this one)
    assert json.loads(_tokenizer(_pre("qwen2")).backend.to_str())["pre_tokenizer"]["pretokenizers"][0][
        "pattern"]["Regex"] == P.QWEN2_PATTERN


def test_char_classes():
    table = P.char_classes()
    assert table.shape == (65536,) and table.dtype == np.uint8
    assert [int(table[ord(c)]) for c in "a1 \n.é中\u00a0\x1c\u2003"] == [
        P.LETTER, P.NUMBER, P.SPACE, P.NEWLINE, P.OTHER, P.LETTER, P.LETTER, P.SPACE, P.OTHER, P.SPACE]
