"""train_draft.py's model drafts (--arch=model): the draft's shape and initialisation, the training
step and its evaluation, the loss curve, the export as a Hugging Face directory, and the measured
cost of a draft step against a target step."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import numpy as np
from absl import app

from experiments import _train_loop as TL


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
    return TL.agreement_stats(agree, mask_BT > 0, k)


def train(cfg, train_params, frozen, tokens, mask, val_tokens, val_mask, work: pathlib.Path, *, steps, batch,
          lr, warmup, weight_decay, clip, seed, log_every, eval_every, ckpt_every, k, stop_after=0, diverged_hint=""):
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
                  schedule=schedule, diverged_hint=diverged_hint)


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
    from specjax.models import llama

    def stepper(cfg, params, dtype):
        cache = llama.init_cache(cfg, 1, context + 8, dtype)._replace(lengths=jnp.full((1,), context, jnp.int32))
        fn = jax.jit(functools.partial(llama.forward_cached, cfg, dtype=dtype))
        tok = jnp.ones((1, 1), jnp.int32)
        jax.block_until_ready(fn(params, tok, cache))
        return lambda: jax.block_until_ready(fn(params, tok, cache))

    run_t = stepper(target.config, target.params, target.dtype)
    run_d = stepper(draft_cfg, jax.tree.map(jnp.asarray, draft_params), jnp.float32)
    return TL.step_cost(run_t, run_d, target.params, draft_params, rounds, context)
