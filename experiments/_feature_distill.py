"""train_draft.py --arch=feature: distils a feature draft (`specjax.models.feature_draft`).

Data are the same greedy continuations as the model drafts'. The target is run once over each
training sequence (teacher-forced) and its last-layer features and argmax tokens are kept
(features.npz in the work directory). The draft at position j reads (x_{j+1}, f_j) and is
trained on two losses: cross-entropy of its reduced-vocabulary logits against the target's
argmax at j + 1 (the token after x_{j+1}), and a smooth-L1 regression of its predicted
feature on f_{j+1} (scaled by the sequence's feature RMS: the residual stream has a few very
large coordinates). Input features get uniform noise (--feature_noise, relative to that RMS).
--chained_loss adds a second pass in which each position reads the draft's own predicted
feature, as the engine's chained steps do (with noise alone such a step agreed on 25% of
held-out positions, the first step on 53%).
--soft_labels T replaces the cross-entropy by the KL divergence to the target's softmax at
temperature T over the draft's vocabulary, computed from f_{j+1} with the target's own head
columns.
"""

from __future__ import annotations

import functools
import pathlib
import time

import numpy as np

from experiments import _common as C
from experiments import _paths
from experiments import _train_loop as TL
from experiments._train_data import DAMAGED


def target_features(target, tokens_NT, batch: int = 8):
    """(features float32[N, T, D], argmax int32[N, T]) of the target teacher-forced on tokens_NT."""
    import jax
    import jax.numpy as jnp
    from specjax.models import llama, quant

    @jax.jit
    def run(params, toks):
        logits, feats, _ = llama.forward_features(target.config, params, toks, dtype=target.dtype)
        return feats.astype(jnp.float32), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    feats, tops = [], []
    for i in range(0, len(tokens_NT), batch):
        chunk = tokens_NT[i: i + batch]
        pad = batch - len(chunk)
        f, t = run(target.params, np.pad(chunk, ((0, pad), (0, 0))))
        feats.append(np.asarray(f)[: len(chunk)])
        tops.append(np.asarray(t)[: len(chunk)])
    return np.concatenate(feats), np.concatenate(tops)


def cached_features(target, tokens_NT, work: pathlib.Path, chunk: int = 64):
    """target_features as (float16 features, argmax), computed `chunk` sequences at a time and
    saved per chunk under work/features/ (named by a hash of the chunk's tokens): a killed run
    keeps the chunks it finished, and a data set that grows reuses the ones it has."""
    import hashlib

    out_dir = work / "features"
    out_dir.mkdir(parents=True, exist_ok=True)
    # a chunk's features belong to one target: its name, shape and compute dtype key the file too
    owner = f"{target.name}|{target.config}|{target.dtype}".encode()
    feats, tops, made, t0 = [], [], 0, time.perf_counter()
    n_chunks = -(-len(tokens_NT) // chunk)
    for c, lo in enumerate(range(0, len(tokens_NT), chunk)):
        part = np.ascontiguousarray(tokens_NT[lo: lo + chunk])
        path = out_dir / f"{hashlib.sha1(part.tobytes() + str(part.shape).encode() + owner).hexdigest()[:16]}.npz"
        if path.exists():
            try:
                with np.load(path) as z:  # read whole here: a flipped bit fails the zip CRC
                    f_part, t_part = z["features"], z["argmax"]
                if f_part.shape[:2] != part.shape or t_part.shape != part.shape:
                    raise ValueError(f"shapes {f_part.shape}, {t_part.shape} for rows {part.shape}")
                feats.append(f_part)
                tops.append(t_part)
                continue
            except DAMAGED as e:
                C.log(f"features: {path} is damaged ({type(e).__name__}: {e}); computing it again")
                path.unlink()
        f, t = target_features(target, part)
        if not np.isfinite(f.astype(np.float16)).all():  # float16 keeps +-65504
            raise _paths.RunError(f"the target's features of chunk {c + 1} do not fit in float16 (+-65504); "
                                  f"cannot cache them")
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, features=f.astype(np.float16), argmax=t)
        tmp.replace(path)
        made += part.size
        el = time.perf_counter() - t0
        C.log(f"features: chunk {c + 1}/{n_chunks}, {made} positions in {el:.0f}s ({made / el:.0f}/s)")
        feats.append(f.astype(np.float16))
        tops.append(t)
    return np.concatenate(feats), np.concatenate(tops)


def readme_texts(min_chars: int = 500) -> list[tuple[str, str]]:
    """(name, long description) of the installed distributions: prose and code at hand, in no
    evaluation set."""
    import importlib.metadata

    seen, out = set(), []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"]
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if name and name.lower() not in seen and len(body) >= min_chars:
            seen.add(name.lower())
            out.append((name, body))
    return out


def text_windows(tokenizer, n: int, seq_len: int) -> list[np.ndarray]:
    """Up to n sequences of at most seq_len + 1 tokens: a chat request about a package, then a
    window of its description as the reply. Teacher-forced, the target gives features and its own
    argmax at every position: training data without generating anything."""
    out = []
    for name, body in readme_texts():
        prefix = tokenizer.chat_prompt_ids(f"Tell me about the Python package {name}: what it does and how to use it.")
        toks = tokenizer.encode(body)
        step = seq_len + 1 - len(prefix)
        if step < 32:
            raise _paths.RunError(f"--seq_len {seq_len} leaves {step} tokens of text after a {len(prefix)}-token "
                                  f"request (--text_sequences needs at least 32)")
        for i in range(0, max(len(toks) - 32, 1), step):
            out.append(np.asarray(list(prefix) + list(toks[i: i + step]), np.int32))
            if len(out) >= n:
                return out
    return out


def valid_mask(lengths_N, T: int) -> np.ndarray:
    """float32[N, T - 2]: 1 where position j's label (the target's argmax at j + 1, predicting
    x_{j+2}) lies inside the sequence."""
    j = np.arange(T - 2)[None]
    return (j + 2 < np.asarray(lengths_N)[:, None]).astype(np.float32)


def draft_vocab(tops_NT, mask_NT2, eos_ids, n: int) -> np.ndarray:
    """The n tokens the target chooses most often on the training positions (EOS included),
    as sorted int32 ids."""
    labels = tops_NT[:, 1:-1][mask_NT2 > 0]
    ids, counts = np.unique(labels, return_counts=True)
    if len(set(eos_ids)) > n:
        raise ValueError(f"a draft vocabulary of {n} tokens cannot hold the {len(set(eos_ids))} EOS ids")
    top = [int(t) for t in ids[np.argsort(-counts, kind="stable")]]
    missing = sorted(set(eos_ids) - set(top[:n]))  # every EOS stays proposable, however rare
    keep = [t for t in top if t not in missing][: n - len(missing)] + missing
    return np.sort(np.asarray(keep, np.int32))


def coverage(tops_NT, mask_NT2, ids) -> float:
    labels = tops_NT[:, 1:-1][mask_NT2 > 0]
    return float(np.isin(labels, ids).mean())


@functools.cache
def make_fns(cfg, make_optimizer, steps: int, lr: float, warmup: int, weight_decay: float, clip: float,
             noise: float, reg_weight: float, soft: float = 0.0, chained: bool = False):
    import jax
    import jax.numpy as jnp
    import optax
    from specjax.models import feature_draft as FD
    from specjax.models import llama, quant

    optimizer, _ = make_optimizer(steps, lr, warmup, weight_decay, clip)

    def forward(train, frozen, tokens_BT, feats_BTD, key, mask_BT2=None, f_in=None):
        """Predicted features and reduced logits at positions 0 .. T - 3 (inputs: the target's
        features with noise, or `f_in` as given)."""
        B, T = tokens_BT.shape
        feats_BTD = feats_BTD.astype(jnp.float32)  # stored as float16
        true_in = feats_BTD[:, : T - 2]
        # the sequence's feature scale over its real positions (padding's features are not its own)
        m_BT = jnp.ones((B, T - 2), jnp.float32) if mask_BT2 is None else mask_BT2.astype(jnp.float32)
        ms_BT = jnp.mean(jnp.square(true_in), axis=-1)
        rms_B11 = jnp.sqrt(jnp.sum(ms_BT * m_BT, axis=1) / jnp.maximum(jnp.sum(m_BT, axis=1), 1.0))[:, None, None] + 1e-6
        if f_in is None:
            f_in = true_in
            if key is not None and noise > 0:
                f_in = f_in + noise * rms_B11 * jax.random.uniform(key, f_in.shape, minval=-1.0, maxval=1.0)
        emb = llama.embed_tokens(frozen["embed"], tokens_BT[:, 1: T - 1])
        pos = jnp.broadcast_to(jnp.arange(T - 2, dtype=jnp.int32), (B, T - 2))
        f_hat, _ = FD.features(cfg, train, emb, f_in, pos)
        return f_hat, FD.logits(cfg, train, f_hat), rms_B11

    def chained_input(feats_BTD, f_hat):
        """Position j's input feature as a chained draft step sees it: the draft's own prediction
        of f_j, made at j - 1 (position 0 keeps the target's)."""
        return jnp.concatenate([feats_BTD[:, :1].astype(jnp.float32), f_hat[:, :-1]], axis=1)

    def terms(frozen, f_hat, logits, rms_B11, feats_BTD, labels_BT2, mask_BT2):
        in_vocab = labels_BT2 >= 0
        if soft > 0:  # the target's own distribution at j + 1 over the draft's vocabulary, from its feature
            teacher = FD.logits(cfg, {"norm": frozen["teacher_norm"], "head": frozen["teacher_head"]},
                                feats_BTD[:, 1:-1].astype(jnp.float32))
            p_t = jax.nn.softmax(teacher / soft, axis=-1)  # KL (the teacher's entropy taken off: 0 is a perfect fit)
            ce = optax.softmax_cross_entropy(logits, p_t) + jnp.sum(p_t * jax.nn.log_softmax(teacher / soft, -1), -1)
        else:
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels_BT2, 0))
        m_ce = mask_BT2 * in_vocab
        ce = jnp.sum(ce * m_ce) / jnp.maximum(jnp.sum(m_ce), 1.0)
        reg = jnp.mean(optax.huber_loss(f_hat / rms_B11, feats_BTD[:, 1:-1].astype(jnp.float32) / rms_B11), axis=-1)
        reg = jnp.sum(reg * mask_BT2) / jnp.maximum(jnp.sum(mask_BT2), 1.0)
        return ce, reg

    def loss_fn(train, frozen, tokens_BT, feats_BTD, labels_BT2, mask_BT2, key):
        f_hat, logits, rms_B11 = forward(train, frozen, tokens_BT, feats_BTD, key, mask_BT2)
        ce, reg = terms(frozen, f_hat, logits, rms_B11, feats_BTD, labels_BT2, mask_BT2)
        aux = {"ce": ce, "feature": reg}
        loss = ce + reg_weight * reg
        if chained:  # a second pass on its own predictions, as the engine's chained steps read them
            f2, logits2, _ = forward(train, frozen, tokens_BT, feats_BTD, None, mask_BT2,
                                     chained_input(feats_BTD, f_hat))
            ce2, reg2 = terms(frozen, f2, logits2, rms_B11, feats_BTD, labels_BT2, mask_BT2.at[:, 0].set(0.0))
            aux.update(ce_chained=ce2, feature_chained=reg2)
            loss = loss + ce2 + reg_weight * reg2
        return loss, aux

    @jax.jit
    def train_step(train, frozen, opt_state, tokens_BT, feats_BTD, labels_BT2, mask_BT2, key):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            train, frozen, tokens_BT, feats_BTD, labels_BT2, mask_BT2, key)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, {"loss": loss, **aux}

    @jax.jit
    def predict(train, frozen, tokens_BT, feats_BTD):
        """Indices into the reduced vocabulary of the draft's choices at positions 0 .. T - 3: its
        first step (the target's features) and a chained step (its own predicted features)."""
        f_hat, logits, _ = forward(train, frozen, tokens_BT, feats_BTD, None)
        _, logits2, _ = forward(train, frozen, tokens_BT, feats_BTD, None, None, chained_input(feats_BTD, f_hat))
        return jnp.argmax(logits, axis=-1), jnp.argmax(logits2, axis=-1)

    return optimizer, train_step, predict


def labels_in_vocab(tops_NT, ids) -> np.ndarray:
    """int32[N, T - 2]: index in the reduced vocabulary of the target's argmax at j + 1 (-1: outside)."""
    lut = np.full(int(max(tops_NT.max(), ids.max())) + 1, -1, np.int32)
    lut[ids] = np.arange(len(ids), dtype=np.int32)
    return lut[tops_NT[:, 1:-1]]


def agreement(pred_NT2, labels_NT2, mask_NT2, k: int) -> dict:
    """Held-out agreement of the draft's first step with the target (teacher-forced, true
    features) and the tau@k these runs would give if later steps did as well: an upper bound,
    since chained steps read predicted features (the engine's tau is the real figure)."""
    agree = (pred_NT2 == labels_NT2) & (labels_NT2 >= 0) & (mask_NT2 > 0)
    return TL.agreement_stats(agree, mask_NT2 > 0, k)


def train(cfg, train_params, frozen, data, val, work: pathlib.Path, *, make_optimizer, steps, batch, lr, warmup,
          weight_decay, clip, seed, log_every, eval_every, ckpt_every, k, stop_after=0, noise=0.1, reg_weight=1.0,
          soft=0.0, chained=False, diverged_hint=""):
    """Runs (or resumes) training; data/val = (tokens, feats, labels, mask). Returns the trained
    params (None after --stop_after). Appends to work/metrics.jsonl. soft > 0: the cross-entropy
    is against the target's softmax at that temperature over the draft's vocabulary (frozen holds
    teacher_head and teacher_norm), not its argmax alone."""
    optimizer, train_step, predict = make_fns(cfg, make_optimizer, steps, lr, warmup, weight_decay, clip, noise,
                                              reg_weight, soft, chained)
    tokens, feats, labels, mask = data

    def step_fn(params, opt_state, rows, key):
        params, opt_state, losses = train_step(params, frozen, opt_state, tokens[rows], feats[rows], labels[rows],
                                               mask[rows], key)
        return params, opt_state, losses, mask[rows].sum()

    def evaluate(params):
        vt, vf, vl, vm = val
        pairs = [predict(params, frozen, vt[i: i + batch], vf[i: i + batch]) for i in range(0, len(vt), batch)]
        first, chained = (np.concatenate([np.asarray(p[i]) for p in pairs]) for i in (0, 1))
        row = agreement(first, vl, vm, k)
        # a chained step's agreement (every input feature the draft's own prediction: the engine's
        # second draft reads one prediction, its context the target's features)
        m2 = (vm > 0).copy()
        m2[:, 0] = False
        row["agree_chained"] = float(((chained == vl) & (vl >= 0))[m2].mean())
        return row

    return TL.run(train_params, optimizer, work, step_fn=step_fn, evaluate=evaluate, n=len(tokens),
                  tokens_per_row=float(mask.sum(1).mean()), steps=steps, batch=batch, seed=seed,
                  log_every=log_every, eval_every=eval_every, ckpt_every=ckpt_every, stop_after=stop_after,
                  diverged_hint=diverged_hint)


def step_cost(target, draft, rounds: int, context: int = 256) -> dict:
    """Bytes read and seconds of one cached step (batch 1): the feature draft's (layer + reduced
    head, the embedding gather) against the target's, timed interleaved."""
    import jax
    import jax.numpy as jnp
    from specjax.models import feature_draft as FD
    from specjax.models import llama

    import specjax

    engine = specjax.Engine(target, draft, method="exact", k=1)  # the parameters as generation reads them
    tparams, dparams = engine.params.target, engine.params.draft
    cache_t = llama.init_cache(target.config, 1, context + 8, target.dtype)._replace(
        lengths=jnp.full((1,), context, jnp.int32))
    tok = jnp.ones((1, 1), jnp.int32)

    @jax.jit
    def f_t(p, c):
        # the kernels the engine uses, if any
        return llama.forward_cached(target.config, p, tok, c, dtype=target.dtype, backend=engine.backend)
    cache_d = llama.init_cache(draft.config, 1, context + 8, jnp.float32)
    pos = jnp.full((1, 1), context, jnp.int32)

    @jax.jit
    def f_d(p, c):
        zero_f = jnp.zeros((1, 1, draft.config.hidden_size))
        f, c = FD.features(draft.config, p["net"], llama.embed_tokens(p["embed"], tok), zero_f, pos, c,
                           backend=engine.backend)
        return jnp.argmax(FD.logits(draft.config, p["net"], f, backend=engine.backend), axis=-1), c

    run_t = lambda: jax.block_until_ready(f_t(tparams, cache_t))  # noqa: E731
    run_d = lambda: jax.block_until_ready(f_d(dparams, cache_d))  # noqa: E731
    run_t(), run_d()
    return TL.step_cost(run_t, run_d, target.params, draft.params, rounds, context)
