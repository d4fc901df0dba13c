"""specjax.vocab_bridge: tables between two byte-level BPE vocabularies and the device translation;
experiments._cross_vocab, the host re-tokenizing yardstick."""

from __future__ import annotations

import os
import pathlib
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

from _tokenizer_corpus import CODE, DIGITS, EMOJI, PROSE, UNICODE, WHITESPACE
from experiments import _cross_vocab as ref
from specjax import bpe, vocab_bridge as vb
from specjax.models.tokenizer import Tokenizer

TRAIN = CODE + PROSE + UNICODE + EMOJI + DIGITS + WHITESPACE


def _tiny(vocab_size, specials, *, digits, corpus, lacking=b""):
    """A byte-level BPE trained on `corpus`, with `specials` first (ids 0..), without the bytes
    `lacking` (SmolLM2 lacks 21 bytes)."""
    backend = Backend(models.BPE())
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[AddedToken(s, special=True) for s in specials],
                                  initial_alphabet=[c for c in pre_tokenizers.ByteLevel.alphabet()
                                                    if vb.byte_decoder()[c] not in lacking],
                                  show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    n = backend.get_vocab_size(with_added_tokens=True)
    eos = backend.token_to_id("<|im_end|>")
    return Tokenizer(backend, vocab_size=n, bos_token_id=None, eos_token_id=eos)


@pytest.fixture(scope="module")
def tiny_pair():
    # Different sizes, corpora and pre-tokenizers, so merges differ; specials partly shared.
    target = _tiny(520, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim|>"], digits=False,
                   corpus=TRAIN * 3)
    draft = _tiny(330, ["<|im_start|>", "<|im_end|>", "<draft_only>"], digits=True,
                  corpus=PROSE * 3 + CODE, lacking=b"\x04\xff")
    assert target.vocab_size != draft.vocab_size and draft.token_to_id(vb._byte_encoder()[4]) is None
    return target, draft


@pytest.fixture(scope="module", params=list(vb.ALGORITHMS))
def pair(request, tiny_pair):
    target, draft = tiny_pair
    return target, draft, vb.build_bridge(target, draft, target_name="tiny-target", draft_name="tiny-draft",
                                          algorithm=request.param, cache=False)  # built here, never read


def _texts(seed=0, n=40):
    rng = random.Random(seed)
    chars = "abcdefgh xyz_(){}:=\n\t0123456789é中文🙂ß→"
    out = [rng.choice(TRAIN) for _ in range(n // 2)]
    out += ["".join(rng.choice(chars) for _ in range(rng.randint(1, 60))) for _ in range(n - n // 2)]
    return out


def _bytes(tok, ids):
    tb = vb.token_bytes(tok)
    return b"".join(tb[i] for i in ids)


def _run(bridge, ids, cap, direction):
    fn = vb.draft_to_target if direction == "d2t" else vb.target_to_draft
    ids_N = jnp.asarray(ids + [0] * (256 - len(ids)), jnp.int32)  # padding past n must be ignored
    out, count, used = _jitted(fn, cap)(bridge, ids_N, jnp.int32(len(ids)))
    return [int(t) for t in out[:int(count)]], int(count), int(used), np.asarray(out)


_JITTED = {}


def _jitted(fn, cap):
    if (fn, cap) not in _JITTED:  # one compilation per (direction, cap, bridge layout)
        _JITTED[fn, cap] = jax.jit(lambda b, i, n: fn(b, i, n, cap))
    return _JITTED[fn, cap]


def test_tables_keep_bytes(pair):
    target, draft, bridge = pair
    if bridge.algorithm == "table":
        for src, dst, ids_VxW, len_V in ((draft, target, bridge.d2t_ids_VdxW, bridge.d2t_len_Vd),
                                         (target, draft, bridge.t2d_ids_VtxW, bridge.t2d_len_Vt)):
            assert ids_VxW.shape[0] == len_V.shape[0] == src.vocab_size
            lacking = {b for b, c in vb._byte_encoder().items() if dst.token_to_id(c) is None}
            for v, data in enumerate(vb.token_bytes(src)):
                k = int(len_V[v])
                if data is not None and lacking & set(data):  # a byte the other side lacks
                    assert k == vb.UNMAPPED
                elif data is not None:
                    assert 1 <= k <= ids_VxW.shape[1]
                    assert _bytes(dst, [int(t) for t in ids_VxW[v, :k]]) == data
    elif bridge.algorithm == "bpe":  # the bytes of each token, and each side's merges as bpe builds them
        assert bridge.draft_hash_H is None and bridge.match_len == 64
        for tok, bytes_VxB, nb_V, merges in ((draft, bridge.draft_bytes_VdxB, bridge.draft_nb_Vd, bridge.draft_merges),
                                             (target, bridge.target_bytes_VtxB, bridge.target_nb_Vt,
                                              bridge.target_merges)):
            for v, data in enumerate(vb.token_bytes(tok)):
                if data is not None:
                    assert bytes(np.asarray(bytes_VxB[v, :int(nb_V[v])])) == data
            for k, want in bpe.merge_tables(tok).items():
                np.testing.assert_array_equal(np.asarray(merges[k]), want)
        assert bridge.merge_steps == max(bpe.search_steps(m["merge_start_V1"])
                                         for m in (bridge.draft_merges, bridge.target_merges))
    else:
        for tok, bytes_VxB, nb_V, hash_H, hid_H in (
                (draft, bridge.draft_bytes_VdxB, bridge.draft_nb_Vd, bridge.draft_hash_H, bridge.draft_hash_id_H),
                (target, bridge.target_bytes_VtxB, bridge.target_nb_Vt, bridge.target_hash_H,
                 bridge.target_hash_id_H)):
            tb = vb.token_bytes(tok)
            for v, data in enumerate(tb):
                if data is not None:
                    assert bytes(np.asarray(bytes_VxB[v, :int(nb_V[v])])) == data
            assert np.all(np.diff(np.asarray(hash_H).astype(np.int64)) >= 0)
            assert [vb.byte_hash(tb[int(i)]) for i in hid_H] == [int(h) for h in hash_H]
    assert bridge.nbytes == sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(bridge)) > 0


@pytest.mark.parametrize("direction", ["d2t", "t2d"])
def test_round_trip_random_texts(pair, direction):
    target, draft, bridge = pair
    src, dst = (draft, target) if direction == "d2t" else (target, draft)
    for i, text in enumerate(_texts()):
        data = text.encode("utf-8")
        ids = vb.encode_bytes(src, data)
        got, count, used, _ = _run(bridge, ids, 256, direction)
        assert used == len(ids)
        assert _bytes(dst, got) == data
        # partial UTF-8: a prefix of whole source tokens may end mid-character; its bytes still match
        for cut in range(1, len(ids) if i % 4 == 0 else 1):
            got, _, used, _ = _run(bridge, ids[:cut], 256, direction)
            assert used == cut and _bytes(dst, got) == _bytes(src, ids[:cut])


def test_partial_utf8_tokens(pair):
    target, draft, bridge = pair
    # a 4-byte emoji split into single-byte tokens in the draft: each maps to the target's byte tokens
    data = "🙂".encode()
    ids = [draft.token_to_id(vb._byte_encoder()[b]) for b in data]
    got, count, used, _ = _run(bridge, ids[:2], 8, "d2t")
    assert used == 2 and _bytes(target, got) == data[:2]
    got, count, used, _ = _run(bridge, ids, 8, "d2t")
    assert _bytes(target, got) == data


def test_cap_at_K(pair):
    target, draft, bridge = pair
    text = "def pop(self):\n        return self.items.pop(-1)\n"
    ids = vb.encode_bytes(draft, text.encode())
    ends = np.cumsum([len(vb.token_bytes(draft)[i]) for i in ids])
    full, *_ = _run(bridge, ids, 512, "d2t")
    for K in (1, 2, 3, 5, 8):
        got, count, used, out = _run(bridge, ids, K, "d2t")
        assert out.shape == (K,) and count <= K and np.all(out[count:] == 0)
        covered = len(_bytes(target, got))
        assert _bytes(target, got) == text.encode()[:covered]
        if bridge.algorithm == "table":  # cut at a whole draft token: the next would not fit
            lens = np.asarray(bridge.d2t_len_Vd)[ids]
            assert used == int(np.sum(np.cumsum(lens) <= K)) and covered == ends[used - 1]
            assert count + lens[used] > K
        else:  # greedy: the first K target tokens of the whole re-segmentation
            assert got == full[:K]
            assert used == int(np.sum(ends <= covered))


def test_special_tokens(pair):
    target, draft, bridge = pair
    hi = vb.encode_bytes(draft, b"Hi there")
    im_end_d, im_end_t = draft.token_to_id("<|im_end|>"), target.token_to_id("<|im_end|>")
    # shared by text: ChatML maps one to one, EOS included
    got, count, used, _ = _run(bridge, hi + [im_end_d] + hi, 64, "d2t")
    assert used == 2 * len(hi) + 1 and got.count(im_end_t) == 1
    at = got.index(im_end_t)
    assert _bytes(target, got[:at]) == _bytes(target, got[at + 1:]) == b"Hi there"
    got, count, used, _ = _run(bridge, [im_end_d], 4, "d2t")
    assert got == [im_end_t] and used == 1
    # no counterpart: the proposal stops before it
    only = draft.token_to_id("<draft_only>")
    got, count, used, _ = _run(bridge, hi + [only] + hi, 64, "d2t")
    assert used == len(hi) and _bytes(target, got) == b"Hi there"
    got, count, used, _ = _run(bridge, [only] + hi, 64, "d2t")
    assert (count, used) == (0, 0)
    # target-only specials: the committed text translates up to them
    for name in ("<|endoftext|>", "<|fim|>"):
        t_hi = vb.encode_bytes(target, b"Hi there")
        got, count, used, _ = _run(bridge, t_hi + [target.token_to_id(name)] + t_hi, 64, "t2d")
        assert used == len(t_hi) and _bytes(draft, got) == b"Hi there"


def test_missing_byte_stops(pair):
    target, draft, bridge = pair
    ids = vb.encode_bytes(target, b"ab\x04cd")
    at = next(i for i, t in enumerate(ids) if b"\x04" in vb.token_bytes(target)[t])
    got, count, used, _ = _run(bridge, ids, 16, "t2d")
    assert used == at and _bytes(draft, got) == _bytes(target, ids[:at])


def test_jit_vmap_ragged_batch(pair):
    target, draft, bridge = pair
    rows = [vb.encode_bytes(draft, t.encode()) for t in _texts(seed=1, n=6)]
    N = max(len(r) for r in rows)
    ids_BxN = jnp.asarray([r + [0] * (N - len(r)) for r in rows], jnp.int32)
    n_B = jnp.asarray([len(r) for r in rows], jnp.int32)
    K = 12
    fn = jax.jit(jax.vmap(lambda i, n: vb.draft_to_target(bridge, i, n, K)))
    out_BxK, count_B, used_B = fn(ids_BxN, n_B)
    assert out_BxK.shape == (len(rows), K)
    for b, r in enumerate(rows):
        got, count, used, _ = _run(bridge, r, K, "d2t")
        assert [int(t) for t in out_BxK[b, :count]] == got
        assert (int(count_B[b]), int(used_B[b])) == (count, used)


def test_not_byte_level_is_refused(pair):
    target, draft, _ = pair
    wordpiece = Backend(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp = Tokenizer(wordpiece, vocab_size=2, bos_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match="tiny-target.*my-bert.*WordPiece"):
        vb.check_bridgeable(target, wp, target_name="tiny-target", draft_name="my-bert")
    with pytest.raises(ValueError, match="tiny-target.*none-draft.*missing"):
        vb.build_bridge(target, None, target_name="tiny-target", draft_name="none-draft")
    plain = Backend(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="draft-x.*byte-level"):
        vb.check_bridgeable(Tokenizer(plain, vocab_size=3, bos_token_id=None, eos_token_id=None), draft,
                            target_name="draft-x")
    vb.check_bridgeable(target, draft)  # the tiny pair itself is fine


def test_host_reference_against_device(pair):
    """FLy's host re-tokenizing and the device translation give the same bytes for whole-character
    text. Their ids differ where the target's BPE would segment differently: the table keeps the
    draft's token boundaries, greedy takes the longest vocabulary entry rather than following the
    merge order, re-tokenizing runs the target's own pre-tokenizer and BPE, which "bpe" runs on the
    device (so there they are equal). And where a token ends
    mid-character, decoding to text turns the partial character into U+FFFD: the host path
    changes the bytes there, the device keeps them. The greedy device output equals its host
    simulation (`greedy_longest_match`, within the target's pre-tokenizer pieces) exactly."""
    target, draft, bridge = pair
    n_same = n_all = 0
    for text in _texts(seed=2):
        ids = vb.encode_bytes(draft, text.encode())
        host = ref.retokenize(draft, target, ids)
        dev, _, used, _ = _run(bridge, ids, 512, "d2t")
        assert used == len(ids)
        assert _bytes(target, dev) == _bytes(target, host) == text.encode()
        if bridge.algorithm == "bpe":  # the target's own encoding, and back the draft's
            assert dev == host == vb.encode_bytes(target, text.encode())
            back, _, _, _ = _run(bridge, vb.encode_bytes(target, text.encode()), 512, "t2d")
            assert back == vb.encode_bytes(draft, text.encode())
        if bridge.algorithm == "greedy":
            assert bridge.target_pieces == "gpt2" and bridge.draft_pieces == "gpt2-digits"
            assert dev == ref.greedy_longest_match(target, text.encode(), max_len=bridge.match_len, pieces="gpt2")
            back, _, _, _ = _run(bridge, vb.encode_bytes(target, text.encode()), 512, "t2d")
            assert back == ref.greedy_longest_match(draft, text.encode(), max_len=bridge.match_len,
                                                    pieces="gpt2-digits")
        n_same += dev == host
        n_all += 1
    if bridge.algorithm == "bpe":
        assert n_same == n_all
    else:
        assert n_same < n_all  # the tiny pair's merges differ: the two are not the same algorithm
    # with the draft's own boundary inside a multi-byte character, only the device keeps the bytes
    emoji = vb.encode_bytes(draft, "🙂".encode())
    if len(emoji) > 1:
        dev, _, _, _ = _run(bridge, emoji[:1], 8, "d2t")
        assert _bytes(target, dev) == _bytes(draft, emoji[:1])
        assert "\ufffd" in target.decode(ref.retokenize(draft, target, emoji[:1]))
    # the context form returns only the new part, re-segmented across the seam
    ctx, new = vb.encode_bytes(draft, b"def add(a, b):"), vb.encode_bytes(draft, b"\n    return a + b\n")
    got = ref.retokenize(draft, target, new, context=ctx)
    assert _bytes(target, got).endswith(b"return a + b\n")


def test_measure_and_bad_settings(tiny_pair):
    target, draft = tiny_pair
    m = ref.measure(draft, target, _texts(seed=3, n=10))
    assert set(m) == {"per-token table", "greedy longest match, across pieces", "greedy longest match in pieces",
                      "BPE merges in pieces (default)", "re-tokenize text (FLy, host)"}
    assert m["re-tokenize text (FLy, host)"]["whole text equal"] == 1.0  # canonical by construction
    assert m["BPE merges in pieces (default)"]["whole text equal"] == 1.0  # its pieces are under the cap
    for row in m.values():
        assert 0 <= row["same position"] <= row["same span"] <= 1
    with pytest.raises(ValueError, match="unknown translation algorithm 'nope'"):
        vb.build_bridge(target, draft, algorithm="nope")
    with pytest.raises(ValueError, match="match_len=0"):
        vb.build_bridge(target, draft, match_len=0)


def _leaves(bridge):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(bridge)]


@pytest.mark.parametrize("algorithm", vb.ALGORITHMS)
def test_tables_are_kept_on_disk_keyed_by_both_tokenizers(tiny_pair, tmp_path, monkeypatch, algorithm):
    """The first build writes the tables under the cache directory, a second reads them (the builder is
    not called), another tokenizer or algorithm gets another file, and what is read equals a fresh build."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    target, draft = tiny_pair
    fresh = _leaves(vb.build_bridge(target, draft, algorithm=algorithm, cache=False))
    path = vb.cache_path(target, draft, algorithm)
    assert path.parent == tmp_path / "vocab_bridge" and not path.exists()
    first = vb.build_bridge(target, draft, algorithm=algorithm)
    assert path.is_file() and first.algorithm == algorithm
    build = vb._build_arrays
    monkeypatch.setattr(vb, "_build_arrays", lambda *a: pytest.fail("built again, not read from disk"))
    second = vb.build_bridge(target, draft, algorithm=algorithm)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(_leaves(second), fresh))
    assert len(_leaves(second)) == len(fresh)
    # the key: both tokenizers' content (one added token more is another vocabulary), and the algorithm
    other = Tokenizer.from_state(target.to_state())
    other.backend.add_tokens(["<extra>"])
    other.vocab_size += 1
    assert vb.cache_path(other, draft, algorithm) != path
    assert vb.cache_path(draft, target, algorithm) != path  # the direction matters
    assert all(vb.cache_path(target, draft, other) != path for other in vb.ALGORITHMS if other != algorithm)
    assert vb.cache_path(Tokenizer.from_state(target.to_state()), draft, algorithm) == path  # same content
    monkeypatch.setattr(vb, "_build_arrays", build)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "wrong shapes"])
def test_a_damaged_table_file_is_warned_about_and_rebuilt(tiny_pair, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    target, draft = tiny_pair
    fresh = _leaves(vb.build_bridge(target, draft, cache=False))
    vb.build_bridge(target, draft)
    path = vb.cache_path(target, draft)
    raw = path.read_bytes()
    if damage == "flip":
        raw = raw[:len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 1]) + raw[len(raw) // 2 + 1:]
    elif damage == "truncate":
        raw = raw[:len(raw) - 100]
    elif damage == "garbage":
        raw = b"not a table file"
    else:  # a valid file of other tables (as another pair's): its checksum holds, its shapes do not
        other = vb.cache_path(draft, target)
        vb.build_bridge(draft, target)
        raw = other.read_bytes()
    path.write_bytes(raw)
    with pytest.warns(UserWarning, match="damaged vocabulary bridge tables"):
        again = vb.build_bridge(target, draft)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(again), fresh))
    monkeypatch.setattr(vb, "_build_arrays", lambda *a: pytest.fail("the rebuilt tables were not written back"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vb.build_bridge(target, draft)


def test_an_unwritable_cache_only_warns(tiny_pair, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECJAX_CACHE", str(blocker))  # its vocab_bridge/ cannot be made
    target, draft = tiny_pair
    with pytest.warns(UserWarning, match="cannot keep the vocabulary bridge's tables"):
        bridge = vb.build_bridge(target, draft)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(bridge), _leaves(vb.build_bridge(target, draft, cache=False))))
    assert not list(tmp_path.glob("**/*.npz")) and not list(tmp_path.glob("**/.*tmp*"))


def _gguf(name):
    try:
        from specjax.models import presets

        return presets.resolve(name)
    except Exception:  # not installed: this test is opt-in
        return None


@pytest.mark.qwen
def test_smollm2_qwen_pair():
    paths = [_gguf(n) for n in ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")]
    if None in paths or not all(os.path.isfile(p) for p in paths):
        pytest.skip("needs the SmolLM2 and Qwen2.5-Coder-0.5B GGUFs")
    qwen, smol = (Tokenizer.from_gguf(pathlib.Path(p)) for p in paths)
    bridge = vb.build_bridge(qwen, smol, target_name="qwen2.5-coder-0.5b", draft_name="smollm2-135m")
    assert bridge.algorithm == "bpe" and bridge.draft_nb_Vd.shape == (49152,) and bridge.target_nb_Vt.shape == (151936,)
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):  # ChatML and EOS shared by text
        assert int(bridge.d2t_special_Vd[smol.token_to_id(name)]) == qwen.token_to_id(name)
    assert int(bridge.d2t_special_Vd[smol.eos_token_id]) == qwen.token_to_id("<|im_end|>")
    text = "def fib(n):\n    \"\"\"Fibonacci → 中文 🙂\"\"\"\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    ids = smol.encode(text)
    got, count, used, _ = _run(bridge, ids, 128, "d2t")
    assert used == len(ids) and qwen.decode(got) == text
    assert got == vb.encode_bytes(qwen, text.encode())  # Qwen's own encoding of the bytes
    back, _, used, _ = _run(bridge, qwen.encode(text), 128, "t2d")
    assert back == vb.encode_bytes(smol, text.encode())
    greedy = vb.build_bridge(qwen, smol, algorithm="greedy")
    got, _, _, _ = _run(greedy, ids, 128, "d2t")
    assert got == ref.greedy_longest_match(qwen, text.encode(), max_len=greedy.match_len, pieces="qwen2")
    chat = smol.chat_prompt_ids("Hi") + smol.encode("Hello!") + [smol.eos_token_id]
    got, _, used, _ = _run(bridge, chat, 128, "d2t")
    assert used == len(chat) and qwen.decode(got) == smol.decode(chat)
    m = ref.measure(smol, qwen, [text])
    assert m["greedy longest match in pieces"]["same span"] > 0.9  # 0.92 (33 of 36)
    assert m["BPE merges in pieces (default)"]["whole text equal"] == 1.0
    assert m["greedy longest match, across pieces"]["same span"] < 0.85  # 0.81: the indentation


def test_pieces_off_cuts_across_them(tiny_pair):
    """`pieces=False` (the ablation) re-cuts the whole buffer, as the simulation without pieces; with
    them the cut agrees with the target's own encoding at least as often on code."""
    target, draft = tiny_pair
    off = vb.build_bridge(target, draft, algorithm="greedy", cache=False, pieces=False)
    on = vb.build_bridge(target, draft, algorithm="greedy", cache=False)
    assert off.char_class_U is None and off.target_pieces == "none" and on.char_class_U.shape == (65536,)
    for text in CODE:
        ids = vb.encode_bytes(draft, text.encode())
        got, _, _, _ = _run(off, ids, 512, "d2t")
        assert got == ref.greedy_longest_match(target, text.encode(), max_len=off.match_len)
    m = ref.measure(draft, target, CODE)
    assert (m["greedy longest match in pieces"]["same span"]
            > m["greedy longest match, across pieces"]["same span"])


def test_sync_tail_reopens_the_seam(tiny_pair):
    """Re-translating from the tail with the next tokens gives the draft the ids of the whole text at
    once, where translating each part alone leaves a seam ("\\n" | "\\n\\n" is not the draft's "\\n\\n\\n")."""
    target, draft = tiny_pair
    bridge = vb.build_bridge(target, draft, cache=False)
    sync = jax.jit(lambda i, n: vb.sync_to_draft(bridge, i, n, 64, with_tail=True))
    seams = 0
    for text in CODE + ["x\n\n\n\ny", "a   b  c", "return  0\n\n\n"]:
        ids = vb.encode_bytes(target, text.encode())
        if len(ids) > 24:  # every part fits the 64 draft ids at once
            continue
        whole, n_whole, adv, _, _ = sync(jnp.asarray(ids + [0] * (64 - len(ids))), len(ids))
        want = [int(t) for t in whole[:int(n_whole)]]
        for cut in range(1, len(ids)):
            first, n1, adv1, tail_t, tail_d = (int(x) if np.ndim(x) == 0 else x for x in
                                              sync(jnp.asarray(ids[:cut] + [0] * (64 - cut)), cut))
            assert adv1 == cut and 0 <= tail_t < cut and 0 <= tail_d < n1
            rest = ids[tail_t:]
            second, n2, adv2, _, _ = sync(jnp.asarray(rest + [0] * (64 - len(rest))), len(rest))
            got = [int(t) for t in first[:tail_d]] + [int(t) for t in second[:int(n2)]]
            assert _bytes(draft, got) == text.encode()
            naive = [int(t) for t in first[:n1]] + [int(t) for t in sync(jnp.asarray(
                ids[cut:] + [0] * (64 - len(ids) + cut)), len(ids) - cut)[0][:int(sync(jnp.asarray(
                    ids[cut:] + [0] * (64 - len(ids) + cut)), len(ids) - cut)[1])]]
            seams += naive != want
            assert got == want or naive != want  # the tail never does worse than the plain seam
        assert int(adv) == len(ids)
    assert seams > 0  # the corpus has seams that the plain cut gets wrong
