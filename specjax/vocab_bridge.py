"""Vocabulary bridge: translate token ids between two byte-level BPE vocabularies on the device.

A draft of another model family speaks its own vocabulary. The compiled loop needs its proposal in
the target's ids, and the target's committed tokens in the draft's ids (for the draft's own context
and KV cache). `build_bridge` builds, once on the host, tables from the two tokenizers; the device
functions are pure `jnp` over them (jit- and vmap-able, no host callback):

    bridge = build_bridge(target_tok, draft_tok, target_name=..., draft_name=...)   # host, once
    ids_K, n, used = draft_to_target(bridge, draft_ids_Kd, n_draft, K)   # K static
    ids_C, m, used = target_to_draft(bridge, target_ids_N, n_target, C)  # C static

Both return the ids (0 past the count), the count, and how many source tokens were consumed whole.

**Algorithms.** All keep the bytes exactly (a byte-level vocabulary has a token for every byte of
text), so a translation's bytes are always the source tokens' bytes.

- `"bpe"` (the default): the destination tokenizer's own encoding of the bytes, on the device
  (`specjax.bpe`): its pre-tokenizer's pieces (`specjax.pretokenize`; a piece is cut at `match_len`,
  64 bytes) and its merges, the lowest rank first, every piece of a 128-slot chunk at once. For text
  whose pieces fit the cap, it equals `tokenizers`' encoding token for token (tested on the tiny
  tokenizers of each pre-tokenizer kind and on SmolLM2 <-> Qwen2.5: all 164 HumanEval prompts with
  solutions, both directions, have pieces of at most 36 bytes). Tables: each side's token bytes,
  merges in a CSR layout and a class per character of the Basic Multilingual Plane (27.0 MiB for
  SmolLM2 <-> Qwen2.5, most of it the token bytes). Batched over 8 rows on a 2-core CPU it costs
  1.4-2.2 ms per translation, greedy 0.6-1.2 ms (`python -m experiments.cross_vocab_reference --cost`).
- `"greedy"`: the bytes re-cut left to right into the longest destination tokens of at most
  `match_len` (32) bytes that stay inside one piece. Each of the C output steps hashes every prefix
  of the next 32 bytes, finds the hashes with `jnp.searchsorted` in a sorted table of the
  destination's token hashes, and checks the candidates byte by byte (so a hash collision can only
  cost a shorter match, never wrong bytes). Inside a piece it takes the longest entry where BPE's
  merge order may not: 97.7 % of its tokens are the target's own on HumanEval, 96 % on MT-Bench.
- `"table"`: row v of a per-token table holds the destination's canonical encoding of source token
  v's bytes alone (its pre-tokenizer and BPE, no normalizer); a row of ids becomes the
  concatenation of its rows (a gather, a cumsum, one scatter). Cheaper, no loop, but it cannot
  merge across the draft's token boundaries (a K-token proposal carries 12 % fewer bytes on code).

Measured on the real tokenizers (experiments/results/vocab_bridge.md, `python -m
experiments.cross_vocab_reference`). FLy's host re-tokenizing of the text is canonical by
construction, as "bpe" is; it differs only where it decodes a partial character to U+FFFD.

**What does not map one to one, and what we do:**

- *BPE merges across token boundaries.* "bpe" and "greedy" re-encode the bytes, so the target's
  token that spans two draft tokens is found ("bpe": where the target's merges make it; "greedy":
  where it is the longest match inside its piece); "table" keeps the draft's boundaries.
  Either way a non-canonical segmentation only lowers acceptance: exact verification compares the
  target's own choices, whatever ids are proposed.
- *Partial UTF-8.* Byte-level tokens may end mid-character. Both algorithms work on bytes, never on
  text, so a character split over two draft tokens reassembles in the target's ids (as its bytes).
  At the end of a proposal the last bytes can be an incomplete character; they stay as they are.
- *Special and chat tokens.* A special token maps to the other vocabulary's special token with the
  same text where there is one (ChatML's `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`), as one
  token. Otherwise a translation stops before it (the tokens after it are not translated; `consumed`
  stops there). Added tokens that are not special (Qwen's `<tool_call>`) are plain text.
- *EOS.* A special token like the others: SmolLM2's EOS `<|im_end|>` becomes Qwen's `<|im_end|>`
  (Qwen2.5-Instruct's EOS), so the target can accept an end of turn; an EOS with no counterpart
  ends the proposal before it.
- *Bytes one vocabulary lacks.* SmolLM2 has no token for 21 bytes (control bytes 0x04, 0x06, ...
  and 0xc0, 0xc1, 0xf1..0xff); a translation stops before a token that needs one.
- *A proposal longer than K.* `draft_to_target` emits at most K target tokens. "bpe" and "greedy"
  emit the first K tokens of the encoding (the last one may end inside a draft token); "table" keeps the
  longest run of whole draft tokens whose rows fit. `consumed` is the number of draft tokens whose
  bytes the output covers whole: the draft's own state beyond them is to be rolled back (or the
  committed target tokens translated back with `target_to_draft`, which is what the draft's cache
  must hold anyway after verification).

**On disk.** `build_bridge` keeps the tables under `specjax.models.presets.cache_dir()/vocab_bridge/`,
in one file per pair named by a hash of both tokenizers' serialized state (`cache_path`), written
atomically with the SHA-256 of its contents in front; a damaged file is warned about and rebuilt, an
unwritable cache only warned about.

`check_bridgeable` refuses, before anything is built or compiled, a tokenizer that is missing or not
a byte-level BPE, naming both models. The module is over 450 lines because it holds the three
algorithms' device entry points (the BPE itself is `specjax.bpe`), their host-side table builders (which share the byte helpers) and their file on disk, the whole-token sync the
cross-vocabulary drafter reads (`sync_to_draft`), and the tables' shapes for planning (`AbstractVocab`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import bpe, pretokenize

UNMAPPED = -1  # row length of a special token with no counterpart: a translation stops before it


byte_decoder = bpe.byte_decoder  # the byte-level alphabet read backwards: character -> byte
_byte_encoder = bpe.byte_encoder


def _special_tokens(tok) -> dict[int, str]:
    """id -> text of the tokenizer's special (control) tokens."""
    return {i: t.content for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}


def token_bytes(tok) -> list[bytes | None]:
    """Each id's bytes; None for a special token (and for an id the vocabulary does not name)."""
    special = _special_tokens(tok)
    added = {i: t.content for i, t in tok.backend.get_added_tokens_decoder().items()}
    table = _piece_table()
    out: list[bytes | None] = []
    for i in range(tok.vocab_size):
        if i in special:
            out.append(None)
            continue
        piece = tok.id_to_token(i)
        if piece is None:
            out.append(None)
        elif i in added:  # a plain added token (`<tool_call>`) is matched as its text
            out.append(piece.encode("utf-8"))
        else:
            try:  # one C-level translate per token (a character per byte was most of the build's time)
                out.append(piece.translate(table).encode("latin-1"))
            except UnicodeEncodeError:  # a character outside the byte-level alphabet
                out.append(None)
    return out


@functools.lru_cache(maxsize=1)
def _piece_table() -> dict[int, str]:
    """str.translate's table from a byte-level piece to its bytes as latin-1 characters: each
    alphabet character to chr(byte), each other character below 256 to U+0100 (which fails the
    latin-1 encoding, as characters above 255 outside the alphabet do by themselves)."""
    table = {ord(c): chr(b) for c, b in byte_decoder().items()}
    return {**{c: "\u0100" for c in range(256)}, **table}


def encode_bytes(tok, data: bytes) -> list[int]:
    """The tokenizer's canonical ids of raw bytes, keeping them exactly.

    Its pre-tokenizer and BPE, without the normalizer (Qwen's NFC would change bytes) and without
    matching special tokens in the text; a run that is not valid UTF-8 goes to the BPE as bytes.
    """
    enc = _byte_encoder()
    model, pre = tok.backend.model, tok.backend.pre_tokenizer
    ids: list[int] = []
    i = 0
    while i < len(data):
        try:
            text, j = data[i:].decode("utf-8"), len(data)
        except UnicodeDecodeError as e:
            j = i + e.start
            text = data[i:j].decode("utf-8")
        if text:
            for piece, _ in pre.pre_tokenize_str(text):
                ids += [t.id for t in model.tokenize(piece)]
        if j < len(data):  # the undecodable run: bytes up to the next valid start
            k = j + 1
            while k < len(data):
                try:
                    data[k:].decode("utf-8")
                    break
                except UnicodeDecodeError as e:
                    if e.start > 0:
                        break
                    k += 1
            ids += [t.id for t in model.tokenize("".join(enc[b] for b in data[j:k]))]
            j = k
        i = j
    return ids


@dataclasses.dataclass(frozen=True)
class AbstractVocab:
    """A byte-level vocabulary known only by its sizes, as an abstract model's tokenizer
    (`models.abstract`): `build_bridge` of two of them gives tables of `jax.ShapeDtypeStruct`s of
    the real sizes, for planning and ahead-of-time compilation (no tokenizer files at hand).

    width: the longest token in bytes (Qwen2.5's and SmolLM2's: 128 and 81).
    pieces: its pre-tokenizer (`specjax.pretokenize.KINDS`; Llama 3's by default)."""

    vocab_size: int
    width: int = 128
    pieces: str = "llama3"


def check_bridgeable(target_tok, draft_tok, *, target_name: str = "target", draft_name: str = "draft") -> None:
    """Raise ValueError naming both models when either tokenizer cannot be bridged.

    Both must be byte-level BPE (`specjax.models.Tokenizer`, whose `tokenizers` BPE has a byte-level
    pre-tokenizer and decoder): then every byte string has an encoding in both vocabularies.
    """
    for role, tok, name in (("target", target_tok, target_name), ("draft", draft_tok, draft_name)):
        why = _not_byte_level(tok)
        if why is not None:
            raise ValueError(f"cannot translate between the vocabularies of {target_name} (target) and "
                             f"{draft_name} (draft): the {role} {name}'s tokenizer {why}; a draft of "
                             "another vocabulary needs two byte-level BPE tokenizers")


def _not_byte_level(tok) -> str | None:
    if tok is None:
        return "is missing"
    if isinstance(tok, AbstractVocab):
        return None
    backend = getattr(tok, "backend", None)
    if backend is None or not hasattr(tok, "vocab_size"):
        return f"is a {type(tok).__name__}, not a specjax.models.Tokenizer"
    model = type(backend.model).__name__
    if model != "BPE":
        return f"is a {model} model, not BPE"
    if "ByteLevel" not in repr(backend.pre_tokenizer) or "ByteLevel" not in repr(backend.decoder):
        return "is a BPE without a byte-level pre-tokenizer and decoder"
    for b, char in _byte_encoder().items():
        # Only the bytes of ordinary text are required: SmolLM2 lacks 21 others (control bytes
        # 0x04, 0x06, ..., and 0xc0, 0xc1, 0xf1..0xff); a translation stops before a token needing one.
        if (0x20 <= b < 0x7F or b in b"\t\n\r") and backend.token_to_id(char) is None:
            return f"has no token for the byte {b:#04x} (not a byte-level vocabulary)"
    return None


@struct.dataclass(kw_only=True)
class Bridge:
    """Device tables for both directions; `algorithm` ("greedy" or "table") says which are filled.

    "table": `d2t_ids_VdxW`/`d2t_len_Vd` and `t2d_ids_VtxW`/`t2d_len_Vt` (per-token rows).
    "greedy": each vocabulary's token bytes (`*_bytes_VxB`, `*_nb_V`), a sorted hash of the byte
    strings of its tokens up to `match_len` bytes (`*_hash_H`, `*_hash_id_H`), and the special-token
    maps (`d2t_special_Vd`, `t2d_special_Vt`: the other side's id, or UNMAPPED).
    "bpe": the token bytes and special maps as "greedy", and each side's merges (`*_merges`) in
    place of the hashes; `match_len` is then the longest piece. Unused fields are None.
    """
    algorithm: str = struct.field(pytree_node=False, default="greedy")
    match_len: int = struct.field(pytree_node=False, default=32)
    target_pieces: str = struct.field(pytree_node=False, default="none")  # pretokenize.KINDS: the
    draft_pieces: str = struct.field(pytree_node=False, default="none")   # re-cut stays inside these pieces
    char_class_U: jax.Array | None = None       # uint8[65536] pretokenize.char_classes(); None: no pieces
    d2t_ids_VdxW: jax.Array | None = None   # int32: target ids of each draft token's bytes, 0-padded
    d2t_len_Vd: jax.Array | None = None     # int32: row lengths; UNMAPPED: a special with no counterpart
    t2d_ids_VtxW: jax.Array | None = None
    t2d_len_Vt: jax.Array | None = None
    draft_bytes_VdxB: jax.Array | None = None   # uint8, 0-padded
    draft_nb_Vd: jax.Array | None = None        # int32 byte counts; 1 for a special (its marker)
    target_bytes_VtxB: jax.Array | None = None
    target_nb_Vt: jax.Array | None = None
    draft_hash_H: jax.Array | None = None       # uint32, sorted
    draft_hash_id_H: jax.Array | None = None    # int32, the draft id of each hash
    target_hash_H: jax.Array | None = None
    target_hash_id_H: jax.Array | None = None
    d2t_special_Vd: jax.Array | None = None     # int32: target id of a draft special; UNMAPPED else
    t2d_special_Vt: jax.Array | None = None
    merge_steps: int = struct.field(pytree_node=False, default=0)  # "bpe": binary-search steps per pair
    target_merges: dict | None = None  # "bpe": `bpe.merge_tables` of each side (byte_tok_256, merge_*)
    draft_merges: dict | None = None

    @property
    def nbytes(self) -> int:
        """Device memory of the tables (for a memory report)."""
        return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self))


def build_table(src_tok, dst_tok) -> tuple[np.ndarray, np.ndarray]:
    """Host: (ids_VxW, len_V) translating each `src_tok` id to `dst_tok` ids (see the module doc)."""
    dst_special = {text: i for i, text in _special_tokens(dst_tok).items()}
    src_special = _special_tokens(src_tok)
    dst_bytes = token_bytes(dst_tok)
    rows: list[list[int]] = []
    lens = np.zeros(src_tok.vocab_size, np.int32)
    cache: dict[bytes, list[int]] = {}
    for v, data in enumerate(token_bytes(src_tok)):
        if data is None:
            dst = dst_special.get(src_special.get(v))
            row = [] if dst is None else [dst]
            lens[v] = UNMAPPED if dst is None else 1
        else:
            row = cache.get(data)
            if row is None:
                row = cache[data] = encode_bytes(dst_tok, data)
            # a byte the other vocabulary lacks (one never in UTF-8): unmapped, not silently dropped
            lens[v] = len(row) if bytes(b"".join(dst_bytes[t] or b"" for t in row)) == data else UNMAPPED
            if lens[v] == UNMAPPED:
                row = []
        rows.append(row)
    width = max(1, max(len(r) for r in rows))
    ids = np.zeros((len(rows), width), np.int32)
    for v, row in enumerate(rows):
        ids[v, :len(row)] = row
    return ids, lens


ALGORITHMS = ("bpe", "greedy", "table")
_MERGE_KEYS = ("byte_tok_256", "merge_start_V1", "merge_right_M", "merge_rank_M", "merge_id_M")
_PLAIN, _NO_COUNTERPART = -1, -2  # the special maps' values besides the other side's id
_HASH_MUL = 0x01000193  # FNV's prime; any odd multiplier works: every hit is checked byte by byte


def byte_hash(data: bytes) -> int:
    """sum((b + 1) * MUL**j) mod 2**32: the host side of `resegment`'s prefix hashes."""
    h, p = 0, 1
    for b in data:
        h = (h + (b + 1) * p) & 0xFFFFFFFF
        p = (p * _HASH_MUL) & 0xFFFFFFFF
    return h


def _bytes_arrays(tok, all_bytes: list[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    """(bytes_VxB uint8, nb_V int32) of `token_bytes(tok)`; a special token: one byte 0 (`resegment`
    marks it apart)."""
    width = max(len(b) for b in all_bytes if b is not None)
    flat = np.zeros((tok.vocab_size, width), np.uint8)
    nb_V = np.ones(tok.vocab_size, np.int32)
    ok = [v for v, b in enumerate(all_bytes) if b is not None]
    nb_V[ok] = [len(all_bytes[v]) for v in ok]
    # one buffer of every token's bytes, scattered into its row: no per-token numpy call
    joined = np.frombuffer(b"".join(all_bytes[v] for v in ok), np.uint8)
    rows = np.repeat(np.asarray(ok, np.int64), nb_V[ok])
    cols = np.arange(joined.size) - np.repeat(np.cumsum(nb_V[ok]) - nb_V[ok], nb_V[ok])
    flat[rows, cols] = joined
    return flat, nb_V


def _hashes(bytes_VxB: np.ndarray, nb_V: np.ndarray) -> np.ndarray:
    """`byte_hash` of every row's first nb_V bytes, vectorized (uint32 arithmetic wraps as mod 2**32)."""
    pow_B = np.asarray([pow(_HASH_MUL, j, 1 << 32) for j in range(bytes_VxB.shape[1])], np.uint32)
    live_VxB = np.arange(bytes_VxB.shape[1])[None, :] < nb_V[:, None]
    terms = (bytes_VxB.astype(np.uint32) + np.uint32(1)) * pow_B[None, :]
    return np.where(live_VxB, terms, np.uint32(0)).sum(axis=1, dtype=np.uint32)


def _hash_arrays(all_bytes: list[bytes | None], bytes_VxB: np.ndarray, nb_V: np.ndarray,
                 match_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The sorted hashes of the tokens of at most `match_len` bytes, and their ids (the first id
    of each byte string)."""
    seen: dict[bytes, int] = {}
    for v, b in enumerate(all_bytes):
        if b and len(b) <= match_len and b not in seen:
            seen[b] = v
    ids = np.fromiter(seen.values(), np.int32, len(seen))
    hashes = _hashes(bytes_VxB[ids], nb_V[ids])
    order = np.argsort(hashes, kind="stable")
    return hashes[order], ids[order]


def _special_map(src_tok, dst_tok) -> np.ndarray:
    dst_special = {text: i for i, text in _special_tokens(dst_tok).items()}
    out = np.full(src_tok.vocab_size, _PLAIN, np.int32)
    for v, text in _special_tokens(src_tok).items():
        out[v] = dst_special.get(text, _NO_COUNTERPART)
    return out


def build_bridge(target_tok, draft_tok, *, target_name: str = "target", draft_name: str = "draft",
                 algorithm: str = "bpe", match_len: int | None = None, cache: bool = True,
                 pieces: bool = True) -> Bridge:
    """Host, once: check both tokenizers and build the device tables of `algorithm`.

    pieces: "greedy" re-cuts within the destination's pre-tokenizer pieces where that pre-tokenizer
    is one `specjax.pretokenize` knows (False: across them, the whole buffer one piece; for
    ablations).

    cache: keep the tables on disk under `specjax.models.presets.cache_dir()`/vocab_bridge, keyed
    by both tokenizers' serialized state (`cache_path`): a later Engine of the same pair reads them
    (about 0.1 s for SmolLM2 -> Qwen2.5, against about a second to build them)."""
    check_bridgeable(target_tok, draft_tok, target_name=target_name, draft_name=draft_name)
    match_len = default_match_len(algorithm) if match_len is None else match_len
    if isinstance(target_tok, AbstractVocab) or isinstance(draft_tok, AbstractVocab):
        return abstract_bridge(target_tok, draft_tok, algorithm=algorithm, match_len=match_len, pieces=pieces)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown translation algorithm {algorithm!r} ({', '.join(ALGORITHMS)})")
    if algorithm != "table" and not 1 <= match_len <= 256:
        raise ValueError(f"match_len={match_len} must be in 1..256")
    path = cache_path(target_tok, draft_tok, algorithm, match_len) if cache else None
    arrays = None if path is None else _read_tables(path, algorithm, target_tok.vocab_size, draft_tok.vocab_size)
    if arrays is None:
        arrays = _build_arrays(target_tok, draft_tok, algorithm, match_len)
        if path is not None:
            _write_tables(path, arrays)
    kinds = _piece_kinds(algorithm, pieces, pretokenize.kind_of(target_tok), pretokenize.kind_of(draft_tok))
    merges = {}
    if algorithm == "bpe":
        for side in ("target", "draft"):
            merges[f"{side}_merges"] = {k: jnp.asarray(arrays.pop(f"{side}_{k}")) for k in _MERGE_KEYS}
        merges["merge_steps"] = max(bpe.search_steps(merges[f"{side}_merges"]["merge_start_V1"])
                                    for side in ("target", "draft"))
    return Bridge(algorithm=algorithm, match_len=match_len, **kinds, **merges,
                  **{k: jnp.asarray(v) for k, v in arrays.items()})


def default_match_len(algorithm: str) -> int:
    """"greedy": the longest match, 32 bytes; "bpe": the longest piece, 64 bytes (HumanEval's
    indentation has whitespace pieces of 33-36 bytes); "table": unused."""
    return 64 if algorithm == "bpe" else 32


def _piece_kinds(algorithm: str, pieces: bool, target: str, draft: str, *, abstract: bool = False) -> dict:
    """Bridge fields of the pre-tokenizer pieces ("table" keeps the draft's own boundaries: none)."""
    if algorithm == "table" or not pieces or (target, draft) == ("none", "none"):
        return {}
    table = (jax.ShapeDtypeStruct((1 << 16,), jnp.uint8) if abstract
             else jnp.asarray(pretokenize.char_classes()))
    return dict(target_pieces=target, draft_pieces=draft, char_class_U=table)


def _build_arrays(target_tok, draft_tok, algorithm: str, match_len: int) -> dict[str, np.ndarray]:
    if algorithm == "table":
        d2t_ids, d2t_len = build_table(draft_tok, target_tok)
        t2d_ids, t2d_len = build_table(target_tok, draft_tok)
        return dict(d2t_ids_VdxW=d2t_ids, d2t_len_Vd=d2t_len, t2d_ids_VtxW=t2d_ids, t2d_len_Vt=t2d_len)
    arrays = {}
    for side, tok in (("draft", draft_tok), ("target", target_tok)):
        all_bytes = token_bytes(tok)
        b, nb = _bytes_arrays(tok, all_bytes)
        arrays.update({f"{side}_bytes_V{side[0]}xB": b, f"{side}_nb_V{side[0]}": nb})
        if algorithm == "bpe":
            arrays.update({f"{side}_{k}": v for k, v in bpe.merge_tables(tok).items()})
        else:
            h, hid = _hash_arrays(all_bytes, b, nb, match_len)
            arrays.update({f"{side}_hash_H": h, f"{side}_hash_id_H": hid})
    arrays["d2t_special_Vd"] = _special_map(draft_tok, target_tok)
    arrays["t2d_special_Vt"] = _special_map(target_tok, draft_tok)
    return arrays


# --- the tables on disk ------------------------------------------------------------------------

_CACHE_FORMAT = "specjax-vocab-bridge-1"  # bump when the tables' meaning changes


def cache_path(target_tok, draft_tok, algorithm: str = "bpe", match_len: int | None = None):
    """Where `build_bridge` keeps the tables of this pair: a file named by a hash of the format,
    the algorithm and both tokenizers' serialized state (`tokenizers.Tokenizer.to_str`: vocabulary,
    merges, added tokens, pre-tokenizer) and sizes; None for a tokenizer that cannot be serialized."""
    from specjax.models import presets

    match_len = default_match_len(algorithm) if match_len is None else match_len
    h = hashlib.sha256(json.dumps([_CACHE_FORMAT, algorithm, int(match_len)]).encode())
    for tok in (target_tok, draft_tok):
        try:
            state = tok.backend.to_str().encode("utf-8")
        except Exception:  # a duck-typed tokenizer without a serialized form: build every time
            return None
        h.update(f"\n{int(tok.vocab_size)} {len(state)}\n".encode())  # lengths: no two states concatenate alike
        h.update(state)
    return presets.cache_dir() / "vocab_bridge" / f"{h.hexdigest()[:40]}.npz"


def _expected_shapes(algorithm: str, Vt: int, Vd: int) -> dict[str, tuple]:
    """The leading (vocabulary) dimension of each stored table: a check of what was read."""
    if algorithm == "table":
        return dict(d2t_ids_VdxW=(Vd,), d2t_len_Vd=(Vd,), t2d_ids_VtxW=(Vt,), t2d_len_Vt=(Vt,))
    if algorithm == "bpe":
        merges = {}
        for side, V in (("target", Vt), ("draft", Vd)):
            merges.update({f"{side}_{k}": () for k in _MERGE_KEYS})
            merges.update({f"{side}_byte_tok_256": (256,), f"{side}_merge_start_V1": (V + 1,)})
        return dict(draft_bytes_VdxB=(Vd,), draft_nb_Vd=(Vd,), target_bytes_VtxB=(Vt,), target_nb_Vt=(Vt,),
                    d2t_special_Vd=(Vd,), t2d_special_Vt=(Vt,), **merges)
    return dict(draft_bytes_VdxB=(Vd,), draft_nb_Vd=(Vd,), target_bytes_VtxB=(Vt,), target_nb_Vt=(Vt,),
                draft_hash_H=(), draft_hash_id_H=(), target_hash_H=(), target_hash_id_H=(),
                d2t_special_Vd=(Vd,), t2d_special_Vt=(Vt,))


def _write_tables(path, arrays: dict[str, np.ndarray]) -> None:
    """One file, written atomically: the SHA-256 of the npz bytes (64 hex digits and a newline),
    then the npz. An unwritable cache only warns: the tables are rebuilt next time."""
    from specjax import _files

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    body = buf.getvalue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _files.atomic_write_bytes(path, hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    except OSError as e:
        warnings.warn(f"{path}: cannot keep the vocabulary bridge's tables ({e}); they are built again "
                      "next time", stacklevel=3)


def _read_tables(path, algorithm: str, Vt: int, Vd: int) -> dict[str, np.ndarray] | None:
    """The tables stored at `path`, or None: absent, or damaged (warned about; the caller rebuilds
    them and writes them over the damaged file)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        digest, body = raw[:64], raw[65:]
        if raw[64:65] != b"\n" or hashlib.sha256(body).hexdigest().encode() != digest:
            raise ValueError("checksum mismatch")
        with np.load(io.BytesIO(body), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        want = _expected_shapes(algorithm, Vt, Vd)
        if set(arrays) != set(want):
            raise ValueError(f"tables {sorted(arrays)}, expected {sorted(want)}")
        for k, lead in want.items():
            if arrays[k].shape[:len(lead)] != lead:
                raise ValueError(f"{k} has shape {arrays[k].shape}, expected {lead} first")
        return arrays
    except Exception as e:  # a damaged npz raises many kinds of errors; each means: rebuild
        warnings.warn(f"{path}: damaged vocabulary bridge tables ({e}); building them again", stacklevel=3)
        return None


def abstract_bridge(target: AbstractVocab, draft: AbstractVocab, *, algorithm: str = "bpe",
                    match_len: int | None = None, pieces: bool = True) -> Bridge:
    """The tables' shapes for two vocabularies of these sizes (every token hashed: an upper bound)."""
    if not (isinstance(target, AbstractVocab) and isinstance(draft, AbstractVocab)):
        raise ValueError("an abstract bridge needs two AbstractVocab sizes (one real tokenizer and one "
                         "abstract cannot be bridged)")
    sds = jax.ShapeDtypeStruct
    Vt, Vd = target.vocab_size, draft.vocab_size
    match_len = default_match_len(algorithm) if match_len is None else match_len
    if algorithm == "table":  # a row holds at most one id per byte
        return Bridge(algorithm="table", d2t_ids_VdxW=sds((Vd, draft.width), jnp.int32), d2t_len_Vd=sds((Vd,), jnp.int32),
                      t2d_ids_VtxW=sds((Vt, target.width), jnp.int32), t2d_len_Vt=sds((Vt,), jnp.int32))
    if algorithm == "bpe":  # every token but the 256 bytes made by one merge: an upper bound
        merges = {}
        for side, V in (("target", Vt), ("draft", Vd)):
            M = max(V - 256, 1)
            merges[f"{side}_merges"] = dict(
                byte_tok_256=sds((256,), jnp.int32), merge_start_V1=sds((V + 1,), jnp.int32),
                **{k: sds((M,), jnp.int32) for k in ("merge_right_M", "merge_rank_M", "merge_id_M")})
        return Bridge(algorithm="bpe", match_len=match_len, merge_steps=max(1, math.ceil(math.log2(max(Vt, Vd)))),
                      **_piece_kinds(algorithm, pieces, target.pieces, draft.pieces, abstract=True), **merges,
                      draft_bytes_VdxB=sds((Vd, draft.width), jnp.uint8), draft_nb_Vd=sds((Vd,), jnp.int32),
                      target_bytes_VtxB=sds((Vt, target.width), jnp.uint8), target_nb_Vt=sds((Vt,), jnp.int32),
                      d2t_special_Vd=sds((Vd,), jnp.int32), t2d_special_Vt=sds((Vt,), jnp.int32))
    return Bridge(algorithm="greedy", match_len=match_len,
                  **_piece_kinds(algorithm, pieces, target.pieces, draft.pieces, abstract=True),
                  draft_bytes_VdxB=sds((Vd, draft.width), jnp.uint8), draft_nb_Vd=sds((Vd,), jnp.int32),
                  target_bytes_VtxB=sds((Vt, target.width), jnp.uint8), target_nb_Vt=sds((Vt,), jnp.int32),
                  draft_hash_H=sds((Vd,), jnp.uint32), draft_hash_id_H=sds((Vd,), jnp.int32),
                  target_hash_H=sds((Vt,), jnp.uint32), target_hash_id_H=sds((Vt,), jnp.int32),
                  d2t_special_Vd=sds((Vd,), jnp.int32), t2d_special_Vt=sds((Vt,), jnp.int32))


# --- device -----------------------------------------------------------------------------------------

def translate(ids_N: jax.Array, n: jax.Array, table_VxW: jax.Array, len_V: jax.Array,
              cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One row: the first `n` of `ids_N` -> (out_C, count, consumed), C = `cap` (static).

    Takes whole source tokens, in order, while their rows fit in `cap` and none is UNMAPPED;
    `consumed` is how many it took, `count` how many ids they became (out_C is 0 past `count`).
    vmap it for a batch of rows of different lengths.
    """
    N, W = ids_N.shape[0], table_VxW.shape[1]
    rows_NxW = table_VxW[ids_N]
    len_N = len_V[ids_N]
    live_N = (jnp.arange(N) < n) & (jnp.cumsum(len_N < 0) == 0)  # before the first unmapped token
    len_N = jnp.where(live_N, len_N, 0)
    end_N = jnp.cumsum(len_N)
    take_N = live_N & (end_N <= cap)
    take_N = jnp.cumprod(take_N.astype(jnp.int32)).astype(bool)  # a prefix of whole tokens
    consumed = take_N.sum().astype(jnp.int32)
    count = jnp.where(consumed > 0, end_N[jnp.maximum(consumed - 1, 0)], 0).astype(jnp.int32)
    pos_NxW = (end_N - len_N)[:, None] + jnp.arange(W)[None, :]
    keep_NxW = take_N[:, None] & (jnp.arange(W)[None, :] < len_N[:, None])
    pos_NxW = jnp.where(keep_NxW, pos_NxW, cap)  # out of range: dropped
    out_C = jnp.zeros((cap,), jnp.int32).at[pos_NxW.reshape(-1)].set(
        rows_NxW.reshape(-1), mode="drop")
    return out_C, count, consumed


def _byte_buffer(ids_N, n, src_bytes_VxB, src_nb_V, src_special_V, pad: int):
    """The bytes of the first `n` source tokens in one buffer -> (buf_S, total, live_N, end_N).

    Byte values 0..255; a special's slot holds 256 + its destination id; -1 past the end (at least
    `pad` slots). A special with no counterpart ends the buffer before it (live_N: the tokens in it;
    end_N: each token's byte end)."""
    N, B = ids_N.shape[0], src_bytes_VxB.shape[1]
    special_N = src_special_V[ids_N]
    live_N = (jnp.arange(N) < n) & (jnp.cumsum(special_N == _NO_COUNTERPART) == 0)
    nb_N = jnp.where(live_N, src_nb_V[ids_N], 0)
    end_N = jnp.cumsum(nb_N)
    val_NxB = jnp.where(special_N[:, None] >= 0, 256 + special_N[:, None],
                        src_bytes_VxB[ids_N].astype(jnp.int32))
    pos_NxB = (end_N - nb_N)[:, None] + jnp.arange(B)[None, :]
    pos_NxB = jnp.where(jnp.arange(B)[None, :] < nb_N[:, None], pos_NxB, N * B)
    buf_S = jnp.full((N * B + pad,), -1, jnp.int32).at[pos_NxB.reshape(-1)].set(val_NxB.reshape(-1), mode="drop")
    return buf_S, end_N[-1], live_N, end_N


def bpe_encode(ids_N: jax.Array, n: jax.Array, src_bytes_VxB, src_nb_V, src_special_V, dst_merges: dict,
               steps: int, cap: int, match_len: int, pieces: str = "none",
               class_U=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One row, the destination's own BPE: the bytes of the first `n` source tokens encoded as the
    destination tokenizer encodes them (its pre-tokenizer's pieces of at most `match_len` bytes,
    its merges; `specjax.bpe`) -> (out_C, count, consumed), C = `cap`. It stops before a special
    token with no counterpart and before a byte the destination lacks; `consumed` counts the source
    tokens whose bytes the output covers whole."""
    chunk = max(128, 2 * match_len)
    buf_S, total, live_N, end_N = _byte_buffer(ids_N, n, src_bytes_VxB, src_nb_V, src_special_V,
                                               bpe.buffer_padding(match_len, chunk))
    byte_tok = dst_merges["byte_tok_256"][jnp.clip(buf_S, 0, 255)]
    lacking_S = (buf_S >= 0) & (buf_S < 256) & (byte_tok < 0)
    total = jnp.minimum(total, jnp.min(jnp.where(lacking_S, jnp.arange(buf_S.shape[0]), total)))
    out_C, count, end = bpe.encode(buf_S, total, cap, dst_merges, steps=steps, pieces=pieces, class_U=class_U,
                                   piece_cap=match_len, chunk=chunk)
    consumed = jnp.sum(live_N & (end_N <= end)).astype(jnp.int32)
    return out_C, count, consumed


def resegment(ids_N: jax.Array, n: jax.Array, src_bytes_VxB, src_nb_V, src_special_V,
              dst_hash_H, dst_hash_id_H, dst_bytes_VxB, dst_nb_V, cap: int,
              match_len: int, pieces: str = "none", class_U=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One row, greedy longest match: the bytes of the first `n` source tokens, re-cut left to right
    into the longest destination tokens (of at most `match_len` bytes) -> (out_C, count, consumed).
    With `pieces` (the destination's pre-tokenizer, `pretokenize.KINDS`) and `class_U`, no token
    crosses a piece boundary: the pieces are measured from the bytes as the cut goes.

    The bytes go into one buffer (a special token is one marker slot); each of the (at most `cap`) steps
    hashes every prefix of the next `match_len` bytes, looks the hashes up with `searchsorted`,
    checks the candidates' bytes, and emits the longest that matches (a byte always does). It
    stops before a special token with no counterpart. `consumed` counts the source tokens whose
    bytes the output covers whole.
    """
    L = match_len
    M = min(L, dst_bytes_VxB.shape[1])  # no destination token is longer than its table's width
    P = L + 4  # a piece is measured in a window of L bytes and looks up to 4 past its start
    buf_S, total, live_N, end_N = _byte_buffer(ids_N, n, src_bytes_VxB, src_nb_V, src_special_V, P)
    cls_S = None if pieces == "none" else pretokenize.byte_classes(buf_S, class_U)
    pow_L = jnp.asarray([pow(_HASH_MUL, j, 1 << 32) for j in range(L)], jnp.uint32)
    len_L = jnp.arange(1, L + 1)

    def more(carry):  # under vmap: until every row is done or stopped
        t, pos, count, stopped, out_C, piece_end = carry
        return (t < cap) & (pos < total) & ~stopped

    def step(carry):
        t, pos, count, _, out_C, piece_end = carry
        win_L = jax.lax.dynamic_slice(buf_S, (pos,), (L,))
        if cls_S is not None:  # a new piece starts where the last one ended
            fresh = pos >= piece_end
            length = pretokenize.piece_len(jax.lax.dynamic_slice(buf_S, (pos,), (P,)),
                                           jax.lax.dynamic_slice(cls_S, (pos,), (P,)), pieces)
            piece_end = jnp.where(fresh, pos + jnp.minimum(length, L), piece_end)
        plain_L = jnp.cumprod(((win_L >= 0) & (win_L < 256)).astype(jnp.int32)).astype(bool)
        h_L = jnp.cumsum((win_L.astype(jnp.uint32) + jnp.uint32(1)) * pow_L, dtype=jnp.uint32)
        at_L = jnp.clip(jnp.searchsorted(dst_hash_H, h_L), 0, dst_hash_H.shape[0] - 1)
        cand_L = dst_hash_id_H[at_L]
        cand_bytes_LxM = dst_bytes_VxB[cand_L, :M].astype(jnp.int32)
        same_LxM = (cand_bytes_LxM == win_L[None, :M]) | (jnp.arange(M)[None, :] >= len_L[:, None])
        hit_L = plain_L & (dst_hash_H[at_L] == h_L) & (dst_nb_V[cand_L] == len_L) & same_LxM.all(axis=1)
        if cls_S is not None:
            hit_L = hit_L & (len_L <= piece_end - pos)
        best = jnp.max(jnp.where(hit_L, len_L, 0))
        special = win_L[0] >= 256
        tok = jnp.where(special, win_L[0] - 256, cand_L[jnp.maximum(best - 1, 0)])
        step_len = jnp.where(special, 1, best)
        active = (pos < total) & (step_len > 0)  # no match: a byte the destination lacks; stop there
        out_C = out_C.at[t].set(jnp.where(active, tok, 0))
        return (t + 1, pos + jnp.where(active, step_len, 0), count + active.astype(jnp.int32), ~active, out_C,
                piece_end)

    # a while_loop, not cap fixed steps: a long cap (a whole prompt) costs only what its bytes need
    _, pos, count, _, out_C, _ = jax.lax.while_loop(
        more, step, (jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.bool_(False), jnp.zeros((cap,), jnp.int32),
                     jnp.int32(0)))
    consumed = jnp.sum(live_N & (end_N <= pos)).astype(jnp.int32)
    return out_C, count, consumed


def draft_to_target(bridge: Bridge, draft_ids_K: jax.Array, n: jax.Array, K: int):
    """A draft proposal -> (target_ids_K, count <= K, draft tokens consumed)."""
    if bridge.algorithm == "table":
        return translate(draft_ids_K, n, bridge.d2t_ids_VdxW, bridge.d2t_len_Vd, K)
    if bridge.algorithm == "bpe":
        return bpe_encode(draft_ids_K, n, bridge.draft_bytes_VdxB, bridge.draft_nb_Vd, bridge.d2t_special_Vd,
                          bridge.target_merges, bridge.merge_steps, K, bridge.match_len, bridge.target_pieces,
                          bridge.char_class_U)
    return resegment(draft_ids_K, n, bridge.draft_bytes_VdxB, bridge.draft_nb_Vd, bridge.d2t_special_Vd,
                     bridge.target_hash_H, bridge.target_hash_id_H, bridge.target_bytes_VtxB,
                     bridge.target_nb_Vt, K, bridge.match_len, bridge.target_pieces, bridge.char_class_U)


def target_to_draft(bridge: Bridge, target_ids_N: jax.Array, n: jax.Array, cap: int):
    """Committed target tokens -> (draft_ids_C, count, target tokens consumed), for the draft's context.

    When every token must pass, give `cap` room for the longest translation (with "greedy", at
    most the byte count; with "table", `t2d_ids_VtxW.shape[1]` per token); otherwise the caller
    carries the unconsumed rest to the next call.
    """
    if bridge.algorithm == "table":
        return translate(target_ids_N, n, bridge.t2d_ids_VtxW, bridge.t2d_len_Vt, cap)
    if bridge.algorithm == "bpe":
        return bpe_encode(target_ids_N, n, bridge.target_bytes_VtxB, bridge.target_nb_Vt, bridge.t2d_special_Vt,
                          bridge.draft_merges, bridge.merge_steps, cap, bridge.match_len, bridge.draft_pieces,
                          bridge.char_class_U)
    return resegment(target_ids_N, n, bridge.target_bytes_VtxB, bridge.target_nb_Vt, bridge.t2d_special_Vt,
                     bridge.draft_hash_H, bridge.draft_hash_id_H, bridge.draft_bytes_VdxB,
                     bridge.draft_nb_Vd, cap, bridge.match_len, bridge.draft_pieces, bridge.char_class_U)


def sync_to_draft(bridge: Bridge, target_ids_N: jax.Array, n: jax.Array, cap: int, *, with_tail: bool = False):
    """Committed target tokens -> (draft_ids_C, count, advance): the draft's context grows by whole
    target tokens only, so a later call goes on exactly where this one stopped.

    `count` draft ids spell the first `consumed` target tokens whole (a re-cut whose last id would
    end inside a target token is cut back to the last token boundary: that token waits for the next
    call). `advance` is how far the caller's sync point moves: `consumed`, or `consumed + 1` past a
    token that cannot be spelled in the draft's vocabulary (a special with no counterpart, a byte the
    draft lacks): that token is left out of the draft's context. When the first token alone needs
    more than `cap` draft ids, the `cap` ids are kept and the rest of it dropped.

    with_tail: also (tail_tokens, tail_ids): the last place before the final target token where a
    draft id ends with a target token (0, 0 if none). A caller that re-translates from there next
    time, with the next tokens after it, lets the draft's ids merge across the seam ("\n\n" then
    "\n" become the draft's one "\n\n\n" token, as the draft's tokenizer would encode the text);
    "table" has no seam to re-open (its tail is the whole output).
    """
    N = target_ids_N.shape[0]
    out_C, count, consumed = target_to_draft(bridge, target_ids_N, n, cap)
    j_N = jnp.arange(N)
    if bridge.algorithm == "table":  # whole rows only: count already spells `consumed` tokens
        blocked = (consumed < n) & (bridge.t2d_len_Vt[target_ids_N[jnp.minimum(consumed, N - 1)]] < 0)
        too_long = (consumed == 0) & (n > 0)  # one token's row wider than cap
        advance = consumed + (blocked | too_long).astype(jnp.int32)
        return (out_C, count, advance, advance, count) if with_tail else (out_C, count, advance)
    # byte ends of the source tokens and of the emitted ids (a special is one slot on both sides)
    end_N = jnp.cumsum(jnp.where(j_N < n, bridge.target_nb_Vt[target_ids_N], 0))
    c_C = jnp.arange(1, cap + 1)
    end_C = jnp.cumsum(jnp.where(c_C <= count, bridge.draft_nb_Vd[out_C], 0))
    at_C = jnp.searchsorted(end_N, end_C, side="left")  # the token whose end could equal end_C
    on_boundary_C = (c_C <= count) & (at_C < n) & (end_N[jnp.minimum(at_C, N - 1)] == end_C)
    whole = jnp.max(jnp.where(on_boundary_C, c_C, 0))  # ids kept
    tokens = jnp.where(whole > 0, at_C[jnp.maximum(whole - 1, 0)] + 1, 0)  # target tokens they spell
    full = count == cap
    advance = jnp.where(tokens == n, n,
                        jnp.where(~full, tokens + 1,  # stopped before an unspellable token: skip it
                                  jnp.where(tokens == 0, 1, tokens)))  # cap reached: rest next time
    keep = jnp.where(full & (tokens == 0) & (n > 0), count, whole)
    out_C = jnp.where(jnp.arange(cap) < keep, out_C, 0)
    out = out_C, keep.astype(jnp.int32), jnp.minimum(advance, n).astype(jnp.int32)
    if not with_tail:
        return out
    before = jnp.max(jnp.where(on_boundary_C & (c_C < whole), c_C, 0))  # the boundary before the last
    tail_tokens = jnp.where(before > 0, at_C[jnp.maximum(before - 1, 0)] + 1, 0)
    # nothing whole (a token cut at cap): no seam to re-open, or the next call would redo it forever
    tail_tokens, before = jnp.where(whole > 0, tail_tokens, out[2]), jnp.where(whole > 0, before, keep)
    return (*out, tail_tokens.astype(jnp.int32), before.astype(jnp.int32))


def translate_host(ids: Sequence[int], table_VxW: np.ndarray, len_V: np.ndarray) -> list[int]:
    """The table translation of a whole sequence on the host, for measuring (stops at UNMAPPED)."""
    out: list[int] = []
    for v in ids:
        k = int(len_V[v])
        if k < 0:
            break
        out += [int(t) for t in table_VxW[v, :k]]
    return out
