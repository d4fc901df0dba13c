"""The CSD correction memory: a fixed-capacity table of (draft, target) -> count.

Open addressing with linear probing over int32 arrays, so the table is a
pytree that jit, vmap and a while_loop carry treat like any other arrays.
The table has 2 * capacity slots and holds at most `capacity` pairs: at load
<= 1/2 a probe ends at a free slot after a few steps, even when "full".
Nothing is ever evicted: once `capacity` pairs are stored, new pairs are
dropped (they keep reading as count 0) and counted in `dropped`.
"""

from __future__ import annotations

import json
import numbers
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import _files

EMPTY = -1  # key of a free slot; token ids are >= 0


class CSDMemory(NamedTuple):
    keys: jax.Array  # int32[C, 2], C = 2 * capacity slots: (draft_token, target_token), EMPTY where free
    counts: jax.Array  # int32[C]
    filled: jax.Array  # int32[]: pairs stored, at most C
    dropped: jax.Array  # int32[]: increments lost because the table was full

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2] // 2

    def to_dict(self) -> dict[tuple[int, int], int]:
        """Host copy of the stored pairs and their counts (inspection, tests)."""
        keys, counts = np.asarray(self.keys), np.asarray(self.counts)
        used = keys[:, 0] != EMPTY
        return {(int(a), int(b)): int(c) for (a, b), c in zip(keys[used], counts[used])}


def _home(a, b, C: int):
    """Home slot of a pair: a murmur-style mix of both token ids, mod C."""
    x = a.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + b.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)
    x = (x ^ (x >> 15)) * jnp.uint32(0xC2B2AE35)
    x = x ^ (x >> 13)
    return (x % jnp.uint32(C)).astype(jnp.int32)


def _find(keys_C2, a, b):
    """Probes for (a, b): (slot, hit, free); free marks the first empty slot of its run."""
    C = keys_C2.shape[0]
    home = _home(a, b, C)

    def look(i):
        slot = (home + i) % C
        key = keys_C2[slot]
        return slot, (key[0] == a) & (key[1] == b), key[0] == EMPTY

    def probing(i):
        _, hit, free = look(i)
        return (i < C) & ~hit & ~free

    i = jax.lax.while_loop(probing, lambda i: i + 1, jnp.int32(0))
    slot, hit, free = look(jnp.minimum(i, C - 1))
    return slot, hit & (i < C), free & (i < C)


def lookup(memory: CSDMemory, a_E, b_E) -> jax.Array:
    """Counts of the pairs (a[e], b[e]); 0 for pairs not stored."""
    slot_E, hit_E, _ = jax.vmap(_find, (None, 0, 0))(memory.keys, a_E, b_E)
    return jnp.where(hit_E, memory.counts[slot_E], 0)


def add(memory: CSDMemory, pairs_E2, inc_E) -> CSDMemory:
    """Adds inc[e] to the count of pairs[e]; entries with inc <= 0 are skipped.

    New pairs are inserted in entry order (row-major for a batch), so a table
    that fills up keeps the earlier ones and drops the rest.
    """
    a_E, b_E = pairs_E2[:, 0].astype(jnp.int32), pairs_E2[:, 1].astype(jnp.int32)
    inc_E = inc_E.astype(jnp.int32)
    C = memory.keys.shape[0]
    slot_E, hit_E, _ = jax.vmap(_find, (None, 0, 0))(memory.keys, a_E, b_E)
    want_E = inc_E > 0
    # Pairs already stored: one parallel scatter-add, duplicates add up.
    counts_C = memory.counts.at[jnp.where(want_E & hit_E, slot_E, C)].add(inc_E, mode="drop")
    # New pairs compete for room: a short sequential loop over them only.
    new_E = want_E & ~hit_E
    order_E = jnp.argsort(~new_E, stable=True)  # new entries first, order kept

    def insert(carry):
        j, keys_C2, counts_C, filled, dropped = carry
        e = order_E[j]
        slot, hit, free = _find(keys_C2, a_E[e], b_E[e])  # hit: an earlier entry inserted it
        take = free & (filled < memory.capacity)
        keys_C2 = keys_C2.at[slot].set(jnp.where(take, jnp.stack([a_E[e], b_E[e]]), keys_C2[slot]))
        counts_C = counts_C.at[slot].add(jnp.where(hit | take, inc_E[e], 0))
        dropped = dropped + jnp.where(hit | take, 0, inc_E[e])
        return j + 1, keys_C2, counts_C, filled + take.astype(jnp.int32), dropped

    num_new = jnp.sum(new_E)
    carry = (jnp.int32(0), memory.keys, counts_C, memory.filled, memory.dropped)
    _, keys_C2, counts_C, filled, dropped = jax.lax.while_loop(lambda c: c[0] < num_new, insert, carry)
    return CSDMemory(keys_C2, counts_C, filled, dropped)


_add_jit = jax.jit(add)


def check_memory(fn: str, memory) -> CSDMemory:
    if not isinstance(memory, CSDMemory):
        raise ValueError(f"{fn}: memory must be a CSDMemory built by verify.csd_memory(), got {type(memory).__name__}")
    return memory


def check_vocab(fn: str, memory: CSDMemory, vocab_size: int) -> CSDMemory:
    """Refuses a memory holding a token id outside [0, vocab_size) (built for another tokenizer)."""
    check_memory(fn, memory)
    keys = np.asarray(memory.keys)
    used = keys[:, 0] != EMPTY
    if used.any() and keys[used].max() >= vocab_size:
        raise ValueError(f"{fn}: the CSD memory has token id {int(keys[used].max())}, outside the target's "
                         f"vocabulary of {vocab_size}: it was built for another tokenizer")
    return memory


def csd_memory(capacity: int, pairs=None, counts=None) -> CSDMemory:
    """A table for up to `capacity` pairs, preloaded with offline counts.

    pairs int[P, 2] of (draft_token, target_token), counts int[P] (default 1
    each); duplicate pairs add up. Host arrays: this runs before jit.
    """
    fn = "csd_memory"
    if not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"{fn}: capacity must be an int >= 1, got {capacity!r}")
    C = 2 * int(capacity)
    memory = CSDMemory(jnp.full((C, 2), EMPTY, jnp.int32), jnp.zeros((C,), jnp.int32), jnp.int32(0), jnp.int32(0))
    if pairs is None:
        if counts is not None:
            raise ValueError(f"{fn}: counts given without pairs")
        return memory
    pairs_P2 = np.asarray(pairs)
    if pairs_P2.ndim != 2 or pairs_P2.shape[1] != 2 or not np.issubdtype(pairs_P2.dtype, np.integer):
        raise ValueError(f"{fn}: pairs must be int[P, 2] of (draft, target), "
                         f"got {pairs_P2.dtype}{list(pairs_P2.shape)}")
    if (pairs_P2 < 0).any():
        raise ValueError(f"{fn}: token ids must be >= 0")
    counts_P = np.ones(len(pairs_P2), np.int32) if counts is None else np.asarray(counts)
    if counts_P.shape != (len(pairs_P2),) or not np.issubdtype(counts_P.dtype, np.integer) or (counts_P < 0).any():
        raise ValueError(f"{fn}: counts must be int[P] >= 0 with P = {len(pairs_P2)}, "
                         f"got {counts_P.dtype}{list(counts_P.shape)}")
    distinct = len(np.unique(pairs_P2[counts_P > 0], axis=0))
    if distinct > capacity:
        raise ValueError(f"{fn}: {distinct} distinct pairs do not fit in capacity {capacity}")
    # Pad P to a power of two with zero counts (skipped by add): fewer compiles.
    P = 1 << max(0, len(pairs_P2) - 1).bit_length()
    pairs_P2 = np.concatenate([pairs_P2, np.zeros((P - len(pairs_P2), 2), pairs_P2.dtype)])
    counts_P = np.concatenate([counts_P, np.zeros(P - len(counts_P), counts_P.dtype)])
    return _add_jit(memory, jnp.asarray(pairs_P2, jnp.int32), jnp.asarray(counts_P, jnp.int32))


def csd_count(memory: CSDMemory, draft_token, target_token) -> jax.Array:
    """int32 count stored for (draft_token, target_token); 0 if absent."""
    check_memory("csd_count", memory)
    a, b = jnp.asarray(draft_token, jnp.int32), jnp.asarray(target_token, jnp.int32)
    return lookup(memory, a[None], b[None])[0]


_MARKER = "specjax_csd_memory.json"  # written last into every saved memory: what may be replaced
_ORBAX_ENTRIES = {"_CHECKPOINT_METADATA", "_METADATA", "_sharding", "manifest.ocdbt", "d", "descriptor",
                  "array_metadatas", "commit_success.txt", _files.MANIFEST}


def is_saved_memory(path) -> bool:
    """Whether `path` is a directory that `save_csd_memory` wrote (and so may replace)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    if os.path.isfile(os.path.join(path, _MARKER)):
        return True
    # A save from before the marker: orbax's own files and nothing else, with a metadata file.
    entries = set(os.listdir(path))
    return ("_CHECKPOINT_METADATA" in entries and
            all(e in _ORBAX_ENTRIES or e.startswith("ocdbt.process_") for e in entries))


def save_csd_memory(path, memory: CSDMemory, *, overwrite: bool = False) -> None:
    """Saves a memory's pairs, counts and capacity with orbax in the directory `path`.

    Only the stored pairs are written (pairs int32[P, 2], counts int32[P],
    capacity), not the table, so the file does not depend on the hash layout.
    Nothing but a saved memory is ever removed: a `path` that exists and is not
    one is refused; an existing memory is replaced only with `overwrite=True`.
    The save goes to a temporary directory beside `path` that then takes its
    place, so an interrupted save leaves the old memory (or nothing) there; a
    SHA-256 manifest of its files, written last, lets `load_csd_memory` catch
    a flipped bit.
    """
    import shutil

    import orbax.checkpoint as ocp

    fn = "save_csd_memory"
    check_memory(fn, memory)
    path = os.path.abspath(path)
    if os.path.lexists(path):
        if not is_saved_memory(path):
            what = "a file" if os.path.isfile(path) else "a link" if os.path.islink(path) else \
                "a directory that is not a saved CSD memory"
            raise FileExistsError(f"{fn}: {path} exists and is {what}; refusing to replace it "
                                  "(choose a new path; nothing was written)")
        if not overwrite:
            raise FileExistsError(f"{fn}: a saved CSD memory exists at {path}; pass overwrite=True to replace it")
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    stored = memory.to_dict()
    pairs_P2 = np.asarray(list(stored), np.int32).reshape(-1, 2)
    counts_P = np.asarray(list(stored.values()), np.int32)
    if not len(pairs_P2):  # orbax writes no zero-size array; one pair of count 0 stores nothing
        pairs_P2, counts_P = np.zeros((1, 2), np.int32), np.zeros((1,), np.int32)
    tree = {"pairs": pairs_P2, "counts": counts_P, "capacity": np.asarray(memory.capacity, np.int32)}
    tmp = os.path.join(parent, f".{name}.tmp{os.getpid()}")
    old = os.path.join(parent, f".{name}.old{os.getpid()}")
    try:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp, tree)
        ckptr.wait_until_finished()
        ckptr.close()
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump({"format": "specjax-csd-memory", "version": 1, "pairs": int(len(stored))}, f)
        _files.write_manifest(tmp)  # last: SHA-256 of every file, checked by load_csd_memory
        if os.path.lexists(path):
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            if os.path.isdir(old) and not os.path.lexists(path):
                os.replace(old, path)  # put the previous memory back
            raise
    finally:  # only our own temporaries are removed
        for d in (tmp, old):
            if os.path.isdir(d):
                shutil.rmtree(d, ignore_errors=True)


def load_csd_memory(path, capacity: int | None = None, vocab_size: int | None = None) -> CSDMemory:
    """The memory `save_csd_memory` wrote at `path` (capacity None: the saved one).

    vocab_size: refuse token ids outside it (a memory of another tokenizer).
    A damaged memory (a file that differs from the manifest written at save, or one orbax
    cannot read) is a `LoadError` naming the file; a memory saved before manifests existed
    loads without that check."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_csd_memory: no saved memory at {path}")
    if os.path.isfile(os.path.join(path, _files.MANIFEST)):
        # checked before orbax reads anything: damaged data never reaches tensorstore
        _files.check_manifest(path)
    try:
        tree = ocp.StandardCheckpointer().restore(path)
        pairs_P2, counts_P = np.asarray(tree["pairs"], np.int32), np.asarray(tree["counts"], np.int32)
        saved_capacity = int(tree["capacity"])
    except Exception as e:  # orbax / tensorstore's own messages run to many lines
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise _files.LoadError(path, f"not a readable saved CSD memory ({first})") from e
    if vocab_size is not None and len(pairs_P2) and pairs_P2.max() >= vocab_size:
        raise ValueError(f"load_csd_memory: {path} has token id {pairs_P2.max()}, outside a vocabulary of "
                         f"{vocab_size}: it was built for another tokenizer")
    return csd_memory(saved_capacity if capacity is None else capacity, pairs_P2, counts_P)
