"""Pre-token boundaries of byte-level BPE tokenizers, on bytes, on the device.

A byte-level BPE tokenizer first splits text into pieces with a regular expression (words with
their leading space, single digits, runs of punctuation, runs of whitespace) and never merges
across a piece. The vocabulary bridge re-cuts bytes into the longest destination tokens; cutting
within the destination's pieces rather than across them is what makes the re-cut agree with the
destination's own encoding on code (indentation: `"\\n    "` then `" return"`, not `"\\n     "` then
`"return"`). Measured on SmolLM2 <-> Qwen2.5 (experiments/results/vocab_bridge.md): the share of
translated tokens that are the destination's canonical token rises from 0.80-0.82 to 0.97-0.98 on
HumanEval.

The splitting rules of the known expressions are written out by hand over character classes, so
that `piece_len` is a few vector operations over a window of bytes (no regex engine on the
device):

    kind          tokenizers                   expression (Hugging Face `tokenizers`)
    "qwen2"       Qwen2, Qwen2.5               (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|
                                               ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+
    "llama3"      Llama 3                      the same with \\p{N}{1,3}
    "gpt2"        GPT-2's ByteLevel regex      's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
    "gpt2-digits" SmolLM2, StarCoder           Digits(individual_digits) first, then GPT-2's
    "none"        anything else                no boundaries (the whole text is one piece)

Characters are classified by their Unicode category (`char_classes`, a table over the Basic
Multilingual Plane; characters above it count as punctuation, as emoji are): letter, number,
whitespace, line break, other. Each byte of a multi-byte character takes its character's class; a
byte that is not part of valid UTF-8 counts as punctuation. The end of the buffer and a special
token both end the text (as the tokenizer splits special tokens out before pre-tokenizing).

Shapes: W the window a piece is measured in, S a buffer of bytes.
"""

from __future__ import annotations

import functools
import json
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np

LETTER, NUMBER, SPACE, NEWLINE, OTHER, SPECIAL, END = range(7)
KINDS = ("qwen2", "llama3", "gpt2", "gpt2-digits", "none")

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


# --- host -------------------------------------------------------------------------------------

def kind_of(tok) -> str:
    """The pre-tokenizer of a `specjax.models.Tokenizer` as one of KINDS ("none": not recognised)."""
    try:
        pre = json.loads(tok.backend.to_str())["pre_tokenizer"]
    except Exception:  # not a tokenizers backend with a serialized form
        return "none"
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    types = [s and s.get("type") for s in steps]
    if types == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
            return {QWEN2_PATTERN: "qwen2", LLAMA3_PATTERN: "llama3"}.get(pattern, "none")
        return "none"
    if types == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if types == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "gpt2-digits"
    return "none"


def _class_of(cp: int) -> int:
    ch = chr(cp)
    if ch in "\r\n":
        return NEWLINE
    if ch.isspace() and not 0x1C <= cp <= 0x1F:  # Unicode's White_Space (str.isspace adds 0x1c-0x1f)
        return SPACE
    if 0xD800 <= cp < 0xE000:  # surrogates: not characters
        return OTHER
    major = unicodedata.category(ch)[0]
    return {"L": LETTER, "N": NUMBER}.get(major, OTHER)


@functools.cache
def char_classes() -> np.ndarray:
    """uint8[65536]: the class of each code point of the Basic Multilingual Plane."""
    return np.array([_class_of(cp) for cp in range(1 << 16)], np.uint8)


def _utf8_len(b: int) -> int:
    return 1 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4


def byte_classes_host(data: bytes) -> list[int]:
    """The class of each byte (plain reference of `byte_classes`)."""
    table, out, i = char_classes(), [OTHER] * len(data), 0
    while i < len(data):
        b = data[i]
        k = 1 if b < 0x80 else 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 0
        if k and i + k <= len(data) and all(0x80 <= x < 0xC0 for x in data[i + 1: i + k]):
            cp = b if k == 1 else b & (0xFF >> (k + 1))
            for x in data[i + 1: i + k]:
                cp = (cp << 6) | (x & 0x3F)
            out[i: i + k] = [int(table[cp]) if cp < (1 << 16) else OTHER] * k
            i += k
        else:
            i += 1  # not valid UTF-8 here: OTHER
    return out


def pieces_host(data: bytes, kind: str) -> list[int]:
    """The byte lengths of the pieces of `data` (plain reference of `piece_len`, piece by piece)."""
    if kind not in KINDS:
        raise ValueError(f"unknown pre-tokenizer kind {kind!r} ({', '.join(KINDS)})")
    if kind == "none":
        return [len(data)] if data else []
    c = byte_classes_host(data)
    n, out, s = len(data), [], 0

    def cls(j):
        return c[j] if j < n else END

    def run(j, classes):
        k = j
        while k < n and c[k] in classes:
            k += 1
        return k - j

    while s < n:
        out.append(_piece_host(data, s, n, cls, run, kind))
        s += out[-1]
    return out


def _piece_host(data, s, n, cls, run, kind) -> int:
    b0 = data[s]
    nxt = data[s + 1: s + 3]
    if b0 == ord("'"):
        low = nxt.lower() if kind in ("qwen2", "llama3") else nxt
        if low[:2] in (b"re", b"ve", b"ll"):
            return 3
        if low[:1] in (b"s", b"t", b"m", b"d"):
            return 2
    c0 = cls(s)
    if kind in ("qwen2", "llama3"):
        if c0 == LETTER:
            return run(s, (LETTER,))
        k0 = _utf8_len(b0)
        if c0 in (SPACE, OTHER) and cls(s + k0) == LETTER:
            return k0 + run(s + k0, (LETTER,))
        if c0 == NUMBER:
            return min(run(s, (NUMBER,)), 1 if kind == "qwen2" else 3)
        sp = int(b0 == 0x20 and cls(s + 1) == OTHER)
        if c0 == OTHER or sp:
            k = sp + run(s + sp, (OTHER,))
            return k + run(s + k, (NEWLINE,))
    else:
        split = kind == "gpt2-digits"
        if split and c0 == NUMBER:
            return 1
        sp = int(b0 == 0x20 and cls(s + 1) in ((LETTER, OTHER) if split else (LETTER, OTHER, NUMBER)))
        c1 = cls(s + sp)
        if sp or c0 == c1:
            if c1 in (LETTER, OTHER) or (c1 == NUMBER and not split):
                return sp + run(s + sp, (c1,))
    r = run(s, (SPACE, NEWLINE))
    if r == 0:
        return 1
    if kind in ("qwen2", "llama3"):
        last = [j for j in range(s, s + r) if cls(j) == NEWLINE]
        if last:
            return last[-1] - s + 1
    after = cls(s + r)
    if kind == "gpt2-digits" and after == NUMBER:  # the digits were split off first: the run ends the text
        return r
    # \s+(?!\S): a run followed by more text leaves its last character to the next piece
    last = max(j for j in range(s, s + r) if not 0x80 <= data[j] < 0xC0) - s
    return last if last > 0 and after not in (END, SPECIAL) else r


# --- device -----------------------------------------------------------------------------------

def byte_classes(buf_S: jax.Array, class_U: jax.Array) -> jax.Array:
    """The class of each slot of a buffer: byte values 0..255, a special token >= 256, -1 past the
    end -> int32 classes (LETTER ... END). class_U: `char_classes()` on the device."""
    buf = buf_S.astype(jnp.int32)
    S = buf.shape[0]
    pad = jnp.concatenate([buf, jnp.full((3,), -1, jnp.int32)])
    b1, b2, b3 = pad[1:S + 1], pad[2:S + 2], pad[3:S + 3]
    cont = lambda x: (x >= 0x80) & (x < 0xC0)
    k = jnp.select([(buf >= 0) & (buf < 0x80), (buf >= 0xC0) & (buf < 0xE0), (buf >= 0xE0) & (buf < 0xF0),
                    (buf >= 0xF0) & (buf < 0xF8)], [1, 2, 3, 4], 0)
    ok = ((k == 1) | ((k == 2) & cont(b1)) | ((k == 3) & cont(b1) & cont(b2))
          | ((k == 4) & cont(b1) & cont(b2) & cont(b3)))
    cp = jnp.select([k == 1, k == 2, k == 3],
                    [buf, ((buf & 0x1F) << 6) | (b1 & 0x3F), ((buf & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (b2 & 0x3F)],
                    0x10000)  # four bytes: above the plane, OTHER
    lead_cls = jnp.where(cp < 0x10000, class_U[jnp.clip(cp, 0, 0xFFFF)].astype(jnp.int32), OTHER)
    lead_cls = jnp.where(ok, lead_cls, OTHER)
    # a continuation byte takes its lead's class when that lead spans it
    cls = lead_cls
    for back in (1, 2, 3):
        prev_k = jnp.concatenate([jnp.zeros((back,), k.dtype), jnp.where(ok, k, 0)[:S - back]])
        prev_cls = jnp.concatenate([jnp.full((back,), OTHER, jnp.int32), lead_cls[:S - back]])
        cls = jnp.where(cont(buf) & (prev_k > back) & (k == 0), prev_cls, cls)
    return jnp.where(buf < 0, END, jnp.where(buf >= 256, SPECIAL, cls))


def piece_len(b_W: jax.Array, c_W: jax.Array, kind: str) -> jax.Array:
    """The byte length of the piece starting at the window's first slot (>= 1; a piece longer than
    the window is cut at its end). b_W: bytes as `byte_classes` takes them; c_W: their classes."""
    W = b_W.shape[0]
    if kind == "none":
        return jnp.int32(W)
    if kind not in KINDS:
        raise ValueError(f"unknown pre-tokenizer kind {kind!r} ({', '.join(KINDS)})")
    idx = jnp.arange(W)
    c_ext = jnp.concatenate([c_W, jnp.full((4,), END, c_W.dtype)])

    def cls(j):
        return c_ext[j]

    def run(j, classes):  # consecutive slots from j whose class is in `classes`
        inside = jnp.isin(c_W, jnp.asarray(classes, c_W.dtype))
        stop = jnp.min(jnp.where(~inside & (idx >= j), idx, W))
        return jnp.maximum(stop - j, 0).astype(jnp.int32)

    b0, b1, b2 = b_W[0], b_W[1], b_W[2]
    c0 = c_W[0]
    lower = lambda x: jnp.where((x >= 0x41) & (x <= 0x5A), x | 0x20, x)
    l1, l2 = (lower(b1), lower(b2)) if kind in ("qwen2", "llama3") else (b1, b2)
    quote = b0 == ord("'")
    three = quote & (((l1 == ord("r")) | (l1 == ord("v"))) & (l2 == ord("e")) | (l1 == ord("l")) & (l2 == ord("l")))
    two = quote & jnp.isin(l1, jnp.asarray([ord(x) for x in "stmd"]))
    choices, values = [three, two], [3, 2]
    if kind in ("qwen2", "llama3"):
        k0 = jnp.select([b0 < 0xC0, b0 < 0xE0, b0 < 0xF0], [1, 2, 3], 4)
        sp = ((b0 == 0x20) & (cls(1) == OTHER)).astype(jnp.int32)
        k_punct = sp + run(sp, (OTHER,))
        choices += [c0 == LETTER, ((c0 == SPACE) | (c0 == OTHER)) & (cls(k0) == LETTER), c0 == NUMBER,
                    (c0 == OTHER) | (sp == 1)]
        values += [run(0, (LETTER,)), k0 + run(k0, (LETTER,)),
                   jnp.minimum(run(0, (NUMBER,)), 1 if kind == "qwen2" else 3),
                   k_punct + run(k_punct, (NEWLINE,))]
    else:
        split = kind == "gpt2-digits"
        after_space = (LETTER, OTHER) if split else (LETTER, OTHER, NUMBER)
        sp = ((b0 == 0x20) & jnp.isin(cls(1), jnp.asarray(after_space))).astype(jnp.int32)
        c1 = cls(sp)
        same = (sp == 1) | (c0 == c1)
        if split:
            choices.append(c0 == NUMBER)
            values.append(1)
        for c in after_space:
            choices.append(same & (c1 == c))
            values.append(sp + run(sp, (c,)))
    r = run(0, (SPACE, NEWLINE))
    after = cls(r)
    last_newline = jnp.max(jnp.where((idx < r) & (c_W == NEWLINE), idx, -1))
    ended = (after == END) | (after == SPECIAL)
    if kind == "gpt2-digits":
        ended = ended | (after == NUMBER)
    last_char = jnp.max(jnp.where((idx < r) & ((b_W < 0x80) | (b_W >= 0xC0)), idx, 0))  # its first byte
    space = jnp.where((last_char > 0) & ~ended, last_char, r)  # \s+(?!\S) leaves the last character
    if kind in ("qwen2", "llama3"):
        space = jnp.where(last_newline >= 0, last_newline + 1, space)
    choices.append(r > 0)
    values.append(space)
    out = jnp.select(choices, [jnp.asarray(v, jnp.int32) for v in values], 1)
    return jnp.clip(out, 1, W).astype(jnp.int32)
