"""A byte-level BPE encoder on the device: the destination tokenizer's own merges, inside its
pre-tokenizer pieces, over a buffer of bytes (jit- and vmap-able, no host callback).

`vocab_bridge`'s "bpe" algorithm calls it to re-encode a proposal's bytes in the other vocabulary
as that vocabulary's tokenizer would (`tokenizers`' BPE: repeatedly merge the adjacent pair of the
lowest merge rank, the leftmost first, until no pair of the piece has a merge).

Host, once per tokenizer: `merge_tables(tok)` reads the merges from the tokenizer's serialized
state into four int32 arrays sorted by (left id, right id), with a row start per left id
(a CSR layout): the pair (a, b) is a binary search for b among row a's right ids. For Qwen2.5
(151,387 merges) that is 2.4 MiB; SmolLM2 (48,900) 0.8 MiB.

Device (`encode`): the buffer is cut into chunks of whole pieces (at most `chunk` slots); in a
chunk, the pieces are measured (`pretokenize.piece_len` at every slot, then their chain from the
chunk's start), every slot starts as its byte's token, and each iteration merges, in every piece
at once, that piece's best pair: `max merges per piece` iterations per chunk, not one per byte.

Shapes: S buffer slots, J slots of a chunk, C output ids, M merges, V vocabulary.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import pretokenize

_NONE = np.int32(2**31 - 1)  # no merge: larger than any rank * J + slot


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's bytes_to_unicode) read backwards: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def byte_encoder() -> dict[int, str]:
    """byte -> its character in the byte-level alphabet."""
    return {b: c for c, b in byte_decoder().items()}


def merge_tables(tok) -> dict[str, np.ndarray]:
    """Host: the merges of a byte-level BPE `specjax.models.Tokenizer` as device tables.

    byte_tok_256: the id of each single byte's token (-1: the vocabulary lacks that byte);
    merge_start_V1: row a of the sorted merges is [start[a], start[a + 1]); merge_right_M,
    merge_rank_M (the merge's index in the tokenizer's list: lower merges first), merge_id_M (the
    merged token). A merge whose result is not in the vocabulary is left out (never applied).
    """
    state = json.loads(tok.backend.to_str())
    model = state["model"]
    vocab: dict[str, int] = model["vocab"]
    V = int(tok.vocab_size)
    left, right, rank, merged = [], [], [], []
    seen = set()
    for r, m in enumerate(model["merges"]):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        ia, ib, ic = vocab.get(a), vocab.get(b), vocab.get(a + b)
        if ia is None or ib is None or ic is None or (ia, ib) in seen or max(ia, ib, ic) >= V:
            continue
        seen.add((ia, ib))  # a repeated pair: its first (lowest) rank is the one applied
        left.append(ia), right.append(ib), rank.append(r), merged.append(ic)
    left_M = np.asarray(left, np.int64)
    order = np.lexsort((np.asarray(right, np.int64), left_M))
    start = np.zeros(V + 1, np.int64)
    np.add.at(start, left_M + 1, 1)
    enc = byte_encoder()
    return dict(byte_tok_256=np.asarray([vocab.get(enc[b], -1) for b in range(256)], np.int32),
                merge_start_V1=np.cumsum(start).astype(np.int32),
                merge_right_M=np.asarray(right, np.int32)[order],
                merge_rank_M=np.asarray(rank, np.int32)[order],
                merge_id_M=np.asarray(merged, np.int32)[order])


def search_steps(merge_start_V1) -> int:
    """Binary-search steps that find any pair: ceil(log2(longest row + 1)) (static)."""
    longest = int(np.max(np.diff(np.asarray(merge_start_V1)))) if np.size(merge_start_V1) > 1 else 0
    return max(1, math.ceil(math.log2(longest + 1)))


def encode_host(tables: dict[str, np.ndarray], piece: list[int]) -> list[int]:
    """Plain reference of one piece's merges (a list of byte values -> ids): the lowest rank, the
    leftmost first, until no pair merges. For tests; `tokenizers` is the reference of both."""
    start, right = tables["merge_start_V1"], tables["merge_right_M"]
    toks = [int(tables["byte_tok_256"][b]) for b in piece]
    while len(toks) > 1:
        best = None
        for i in range(len(toks) - 1):
            a, b = toks[i], toks[i + 1]
            lo, hi = int(start[a]), int(start[a + 1])
            j = lo + int(np.searchsorted(right[lo:hi], b))
            if j < hi and right[j] == b and (best is None or tables["merge_rank_M"][j] < best[0]):
                best = (int(tables["merge_rank_M"][j]), i, int(tables["merge_id_M"][j]))
        if best is None:
            break
        _, i, new = best
        toks[i:i + 2] = [new]
    return toks


def _lookup(a_J, b_J, start_V1, right_M, rank_M, id_M, steps: int):
    """(found_J, rank_J, id_J) of the pairs (a, b): a lower-bound search of b in row a."""
    M = right_M.shape[0]
    a = jnp.clip(a_J, 0, start_V1.shape[0] - 2)
    lo, end = start_V1[a], start_V1[a + 1]
    hi = end
    for _ in range(steps):  # lower bound: the first right id >= b
        mid = (lo + hi) // 2
        less = right_M[jnp.clip(mid, 0, M - 1)] < b_J
        go = lo < hi
        lo, hi = jnp.where(go & less, mid + 1, lo), jnp.where(go & ~less, mid, hi)
    at = jnp.clip(lo, 0, M - 1)
    found = (lo < end) & (right_M[at] == b_J) & (a_J >= 0) & (b_J >= 0)
    return found, rank_M[at], id_M[at]


def buffer_padding(piece_cap: int, chunk: int) -> int:
    """The slots of -1 that `encode` needs past the text: a chunk, and a piece's look past it."""
    return chunk + piece_cap + 4


def encode(buf_S: jax.Array, total: jax.Array, cap: int, tables, *, steps: int, pieces: str = "none",
           class_U=None, piece_cap: int = 32, chunk: int = 128):
    """One row: the bytes buf_S[:total] (values 0..255; a special token is one slot 256 + its
    destination id, its own piece) -> (out_C, count, end): the first `count` <= C = `cap` ids of the
    encoding, and the byte position where they end.

    buf_S must hold at least `buffer_padding(piece_cap, chunk)` slots of -1 past `total`. tables: a mapping
    with `merge_tables`' arrays (device). pieces: the pre-tokenizer (`pretokenize.KINDS`; "none":
    pieces of `piece_cap` bytes), with class_U its character classes. A piece longer than
    `piece_cap` bytes is cut there (as `tokenizers` would not: keep the cap above the text's pieces).
    """
    J, L = chunk, piece_cap
    P = L + 4  # piece_len's window: the piece and a look of up to 4 slots past it
    if J < L:
        raise ValueError(f"chunk={chunk} must hold a whole piece of piece_cap={piece_cap}")
    cls_S = None if pieces == "none" else pretokenize.byte_classes(buf_S, class_U)
    idx_J = jnp.arange(J)
    byte_tok = tables["byte_tok_256"]
    search = (tables["merge_start_V1"], tables["merge_right_M"], tables["merge_rank_M"], tables["merge_id_M"])

    def piece_lengths(pos, rem):
        win_W = jax.lax.dynamic_slice(buf_S, (pos,), (J + P,))
        if cls_S is None:
            plen = jnp.full((J,), L, jnp.int32)
        else:
            cls_W = jax.lax.dynamic_slice(cls_S, (pos,), (J + P,))
            plen = jax.vmap(lambda j: pretokenize.piece_len(jax.lax.dynamic_slice(win_W, (j,), (P,)),
                                                            jax.lax.dynamic_slice(cls_W, (j,), (P,)), pieces))(idx_J)
        # a special token is its own piece, and no piece runs into one (the pre-tokenizer never sees it)
        special_W = win_W >= 256
        next_special = jax.lax.cummin(jnp.where(special_W, jnp.arange(J + P), J + P), reverse=True)[:J]
        plen = jnp.where(special_W[:J], 1, jnp.minimum(jnp.minimum(plen, L), next_special - idx_J))
        return win_W[:J], jnp.maximum(jnp.minimum(plen, rem - idx_J), 1)

    def chunk_step(carry):
        pos, count, out_C = carry
        rem = jnp.minimum(total - pos, J)
        win_J, plen_J = piece_lengths(pos, total - pos)

        def chain(c):
            j, prev, start_J = c
            return j + plen_J[jnp.minimum(j, J - 1)], j, start_J.at[j].set(True)

        j, prev, start_J = jax.lax.while_loop(lambda c: c[0] < rem, chain,
                                              (jnp.int32(0), jnp.int32(0), jnp.zeros((J,), bool)))
        end = jnp.where(j <= rem, j, prev)  # whole pieces only (the chunk's last may cross its end)
        alive_J = idx_J < end
        pid_J = jnp.cumsum(start_J & alive_J)
        special_J = win_J >= 256
        tok_J = jnp.where(special_J, win_J - 256, byte_tok[jnp.clip(win_J, 0, 255)])

        def merge(c):
            tok_J, alive_J, _ = c
            nxt_J = jax.lax.cummin(jnp.where(alive_J, idx_J, J), reverse=True)
            nxt_J = jnp.concatenate([nxt_J[1:], jnp.full((1,), J, nxt_J.dtype)])
            at = jnp.minimum(nxt_J, J - 1)
            valid = alive_J & (nxt_J < end) & (pid_J[at] == pid_J) & ~special_J & ~special_J[at]
            found, rank, new = _lookup(tok_J, tok_J[at], *search, steps)
            key = jnp.where(valid & found, rank * J + idx_J, _NONE)
            best = jax.ops.segment_min(key, pid_J, num_segments=J + 1)
            do = (key == best[pid_J]) & (key < _NONE)
            killed = jnp.zeros((J,), bool).at[jnp.where(do, nxt_J, J)].set(True, mode="drop")
            return jnp.where(do, new, tok_J), alive_J & ~killed, jnp.any(do)

        tok_J, alive_J, _ = jax.lax.while_loop(lambda c: c[2], merge, (tok_J, alive_J, jnp.bool_(True)))
        rank_J = jnp.cumsum(alive_J) - 1  # each token's place among the chunk's
        room = cap - count
        emit = alive_J & (rank_J < room)
        out_C = out_C.at[jnp.where(emit, count + rank_J, cap)].set(tok_J, mode="drop")
        n = jnp.sum(alive_J)
        # cut at cap: the bytes end where the first token left out starts
        cut = jnp.min(jnp.where(alive_J & (rank_J >= room), idx_J, J))
        return pos + jnp.where(n > room, cut, end), count + jnp.minimum(n, room), out_C

    pos, count, out_C = jax.lax.while_loop(lambda c: (c[0] < total) & (c[1] < cap), chunk_step,
                                           (jnp.int32(0), jnp.int32(0), jnp.zeros((cap,), jnp.int32)))
    return out_C, count.astype(jnp.int32), pos.astype(jnp.int32)
