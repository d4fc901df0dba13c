"""The CSD memory: a fixed-capacity hash table that is a pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import verify


def test_offline_counts_add_up_and_read_back():
    memory = verify.csd_memory(8, [[3, 1], [4, 1], [3, 1], [5, 2]], [2, 1, 5, 0])
    assert memory.to_dict() == {(3, 1): 7, (4, 1): 1}  # duplicates add; a zero count stores nothing
    assert int(memory.filled) == 2 and int(memory.dropped) == 0 and memory.capacity == 8
    assert int(verify.csd_count(memory, 3, 1)) == 7
    assert int(verify.csd_count(memory, 1, 3)) == 0  # order matters: (draft, target)
    assert verify.csd_memory(4, [[1, 2]]).to_dict() == {(1, 2): 1}  # counts default to 1


def test_many_pairs_with_collisions_fit_exactly_at_capacity():
    rng = np.random.default_rng(0)
    pairs = np.unique(rng.integers(0, 50_000, (1500, 2)), axis=0)[:1000]
    counts = rng.integers(1, 100, len(pairs))
    memory = verify.csd_memory(1000, pairs, counts)
    assert memory.to_dict() == {(int(a), int(b)): int(c) for (a, b), c in zip(pairs, counts)}
    lookup = jax.jit(jax.vmap(verify.csd_count, in_axes=(None, 0, 0)))
    np.testing.assert_array_equal(lookup(memory, pairs[:, 0], pairs[:, 1]), counts)
    np.testing.assert_array_equal(lookup(memory, pairs[:, 1] + 50_000, pairs[:, 0]), 0)


B, K, V = 4, 2, 10  # one shape for the hand-made rounds below: one compile
CSD_BATCH = jax.jit(lambda d, L, m, k, active, tau, update: verify.csd_batch(
    d, L, m, tau=tau, num_draft=k, active=active, update=update), static_argnames="update")


def csd_round(memory, rows, active=None, tau=0.0, update=True):
    """csd_batch on rows of (draft, target) mismatches; unused rows are inactive, unused slots padding."""
    d, L = np.zeros((B, K), np.int32), np.zeros((B, K + 1, V), np.float32)
    k, active_B = np.zeros(B, np.int32), np.zeros(B, bool)
    active_B[:len(rows)] = True if active is None else active
    for b, row in enumerate(rows):
        k[b] = len(row)
        for i, (draft, target) in enumerate(row):
            d[b, i], L[b, i, target] = draft, 1.0
    return CSD_BATCH(d, L, memory, k, active_B, np.float32(tau), update)


def test_full_table_drops_new_pairs_in_row_major_order_and_never_evicts():
    memory = verify.csd_memory(3, [[9, 0]], [100])  # one slot taken; min_count=6 passes (9, 0)
    # row 0: (9,0) loose, then (1,0) stops the scan; row 1: (2,0) stops; row 2: (3,0) stops.
    rows = [[(9, 0), (1, 0)], [(2, 0), (9, 0)], [(3, 0), (9, 0)]]
    verdict, after = csd_round(memory, rows)
    np.testing.assert_array_equal(verdict.num_accepted[:3], [1, 0, 0])
    # (1,0) and (2,0) take the two free slots in row-major order; (3,0) is dropped.
    assert after.to_dict() == {(9, 0): 101, (1, 0): 1, (2, 0): 1}
    assert int(after.filled) == 3 and int(after.dropped) == 1
    # Full: known pairs still count, new ones keep dropping and read as 0.
    _, again = csd_round(after, rows)
    assert again.to_dict() == {(9, 0): 102, (1, 0): 2, (2, 0): 2}
    assert int(again.dropped) == 2 and int(verify.csd_count(again, 3, 0)) == 0


def test_duplicate_new_pairs_in_one_round_add_up_after_the_round():
    # Both rows read the start-of-round table (count 6, not > 6) and stop; both increments land.
    memory = verify.csd_memory(3, [[1, 0]], [6])
    verdict, after = csd_round(memory, [[(1, 0)], [(1, 0)], [(2, 0)], [(2, 0)]])
    np.testing.assert_array_equal(verdict.num_accepted, 0)
    assert after.to_dict() == {(1, 0): 8, (2, 0): 2}


def test_update_false_and_inactive_rows_leave_the_table_alone():
    memory = verify.csd_memory(3, [[1, 0]], [6])
    _, same = csd_round(memory, [[(1, 0)], [(2, 0)]], update=False)
    assert same.to_dict() == memory.to_dict()
    _, after = csd_round(memory, [[(2, 0)], [(1, 0)]], active=[False, True])
    assert after.to_dict() == {(1, 0): 7}


def test_memory_is_a_while_loop_carry():
    rng = np.random.default_rng(1)
    R, B, K, V = 6, 3, 4, 3
    d = rng.integers(0, V, (R, B, K)).astype(np.int32)
    L = rng.integers(0, 3, (R, B, K + 1, V)).astype(np.float32)
    step = jax.jit(lambda m, r: verify.csd_batch(jnp.asarray(d)[r], jnp.asarray(L)[r], m, min_count=1, tau=0.2))

    @jax.jit
    def rounds(memory):
        def body(carry):
            r, m, loose = carry
            v, m = verify.csd_batch(jnp.asarray(d)[r], jnp.asarray(L)[r], m, min_count=1, tau=0.2)
            return r + 1, m, loose + v.num_loose.sum()
        return jax.lax.while_loop(lambda c: c[0] < R, body, (0, memory, 0))

    _, in_loop, loose = rounds(verify.csd_memory(16))
    memory, python_loose = verify.csd_memory(16), 0
    for r in range(R):
        v, memory = step(memory, r)
        python_loose += int(v.num_loose.sum())
    assert in_loop.to_dict() == memory.to_dict() and int(loose) == python_loose > 0


@pytest.mark.parametrize("args, match", [
    ((0,), "capacity"),
    ((2, [[1, 2], [3, 4], [5, 6]]), "3 distinct pairs do not fit in capacity 2"),
    ((4, [[-1, 2]]), ">= 0"),
    ((4, [1, 2]), r"int\[P, 2\]"),
    ((4, [[1, 2]], [1, 2]), "counts"),
    ((4, None, [1]), "counts given without pairs"),
])
def test_bad_construction_raises(args, match):
    with pytest.raises(ValueError, match=match):
        verify.csd_memory(*args)


def test_save_and_load_round_trip(tmp_path):
    """What a generate call taught the memory survives orbax: same pairs, counts, capacity."""
    memory = verify.csd_memory(16, np.array([[3, 4], [5, 6], [3, 4], [7, 7]]), np.array([1, 2, 5, 0]))
    verify.save_csd_memory(tmp_path / "m", memory)
    loaded = verify.load_csd_memory(tmp_path / "m")
    assert loaded.capacity == 16 and loaded.to_dict() == memory.to_dict() == {(3, 4): 6, (5, 6): 2}
    assert verify.load_csd_memory(tmp_path / "m", capacity=4).capacity == 4
    verify.save_csd_memory(tmp_path / "empty", verify.csd_memory(8))  # orbax cannot write zero-size arrays
    assert verify.load_csd_memory(tmp_path / "empty").to_dict() == {}
    with pytest.raises(ValueError, match="outside a vocabulary of 6"):
        verify.load_csd_memory(tmp_path / "m", vocab_size=6)
    with pytest.raises(ValueError, match="do not fit in capacity 1"):
        verify.load_csd_memory(tmp_path / "m", capacity=1)
    with pytest.raises(FileNotFoundError, match="no saved memory"):
        verify.load_csd_memory(tmp_path / "nothing")


def test_a_flipped_bit_in_any_file_of_a_saved_memory_is_caught(tmp_path):
    """Every file of a saved memory is under its SHA-256 manifest: one flipped bit anywhere is a
    LoadError naming that file, before orbax reads anything."""
    import shutil

    from specjax._files import MANIFEST, LoadError

    memory = verify.csd_memory(16, np.array([[3, 4], [5, 6]]), np.array([7, 2]))
    verify.save_csd_memory(tmp_path / "m", memory)
    files = sorted(f for f in (tmp_path / "m").rglob("*") if f.is_file() and f.name != MANIFEST)
    assert len(files) >= 3
    for f in files:
        shutil.copytree(tmp_path / "m", tmp_path / "x")
        g = tmp_path / "x" / f.relative_to(tmp_path / "m")
        data = bytearray(g.read_bytes())
        data[len(data) // 2] ^= 0x10
        g.write_bytes(bytes(data))
        with pytest.raises(LoadError, match="SHA-256 differs") as e:
            verify.load_csd_memory(tmp_path / "x")
        assert e.value.path == str(g) and "\n" not in str(e.value)
        shutil.rmtree(tmp_path / "x")
    assert verify.load_csd_memory(tmp_path / "m").to_dict() == memory.to_dict()


def test_a_memory_without_a_manifest_loads_and_unreadable_data_is_one_line(tmp_path):
    from specjax._files import MANIFEST, LoadError

    memory = verify.csd_memory(16, np.array([[3, 4], [5, 6]]), np.array([7, 2]))
    verify.save_csd_memory(tmp_path / "m", memory)
    (tmp_path / "m" / MANIFEST).unlink()  # as saved before manifests existed
    assert verify.load_csd_memory(tmp_path / "m").to_dict() == memory.to_dict()
    (tmp_path / "m" / "_METADATA").write_text("{not json")
    with pytest.raises(LoadError, match="not a readable saved CSD memory") as e:
        verify.load_csd_memory(tmp_path / "m")
    assert e.value.path == str(tmp_path / "m") and "\n" not in str(e.value)
