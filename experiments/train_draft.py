r"""Distills a small Llama-style draft for a target (self-distillation with optax), and exports
it as a Hugging Face directory that `specjax.models.load` opens and `Engine(target, draft=...)` accepts.

    python experiments/train_draft.py --out=/tmp/smollm2-draft            # SmolLM2, default recipe
    python experiments/train_draft.py --target=random:tiny --out=/tmp/d --steps=20 --width=32 --head_dim=16

Stages, each resumable from --work_dir (default: OUT.work; docs/training.md says what it holds):
  1. data: the target's own greedy continuations (batched, with the Engine) of prompts that
     the benchmarks do not evaluate on: MT-Bench questions [--mtbench_from, 80) (both turns),
     HumanEval problems [--humaneval_from, 164), package descriptions from the installed
     distributions' metadata and --chat_prompts synthetic chat requests (_chat_prompts.py).
     Each batch is saved as it finishes (data/chunk_NNNNN.npz); a damaged one is made again.
  2. training: AdamW with linear warmup + cosine decay and global-norm clipping, on the
     cross-entropy of the target's greedy token (in a greedy continuation the next token is
     the target's argmax). Orbax CheckpointManager every --ckpt_every steps, each checkpoint
     with a SHA-256 manifest: a killed run continues from its last intact checkpoint with the
     same batches. A loss that is not finite stops the run. Progress lines give step, loss,
     tokens/s and, every --eval_every steps, teacher-forced acceptance on held-out sequences;
     metrics.jsonl and loss_curve.png in the work directory.
  3. export: OUT/config.json (transformers.LlamaConfig), OUT/model.safetensors, the target's
     tokenizer (tokenizer.json + tokenizer_config.json, written by transformers) and
     SHA256SUMS.json, written beside OUT, loaded back and checked, then renamed into place: an
     earlier draft at OUT stays as it was unless the new one is whole.
The work directory records the settings that made it (made_by.json): a rerun with other data
or training settings refuses in one line rather than mixing them.

Architecture. SmolLM2-135M's tied embedding/LM head (49152 x 576, float32) is 113 MB of the
loaded model's 246 MB (its layers are Q4_1): a draft that reuses the target's head reads half
the target's bytes per step. So the default draft is narrow: width --width with its own tied
embedding, initialised from the target's embedding projected onto its top --width principal
directions (a low-rank copy of the target's head), and --layers layers. `--width=0` instead
keeps the target's width and (frozen) embedding and initialises the layers from the target's
first layers. The binary prints the measured bytes and time of a draft step against a target
step (interleaved) before training. The training logic lives in _train_data (prompts and
continuations), _train_model (the model draft), _feature_distill (--arch=feature), _train_loop
(the shared loop) and _train_work (paths, the work directory's record, the export).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from typing import ClassVar

import numpy as np
from absl import app, flags

from experiments import _common as C
from experiments import _feature_distill as FD
from experiments import _paths
from experiments import _train_data as TD
from experiments import _train_model as TM
from experiments import _train_work as TW

# the library side, under the names tests and notebooks use
Arch, draft_config, init_draft, make_optimizer = TM.Arch, TM.draft_config, TM.init_draft, TM.make_optimizer
train, acceptance, export, hf_tensors, step_cost = TM.train, TM.acceptance, TM.export, TM.hf_tensors, TM.step_cost
generate_data, pack, package_texts = TD.generate_data, TD.pack, TD.package_texts

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

# --- settings -----------------------------------------------------------------------------------

_DATA_FLAGS = ("gen_tokens", "gen_batch", "num_data_prompts", "mtbench_from", "humaneval_from", "package_prompts",
               "chat_prompts")
_SHAPE_FLAGS = {"model": ("width", "layers", "head_dim", "kv_heads", "ffn"),
                "feature": ("draft_vocab", "feature_noise", "text_sequences", "feature_weight", "chained_loss",
                            "soft_labels")}
_RECIPE = ("batch", "lr", "warmup", "weight_decay", "clip", "seed")


def settings(tc: TrainConfig) -> tuple[dict, dict]:
    """(data, training) settings of this run, by flag name: what made WORK/data and WORK/ckpt."""
    f = flags.FLAGS
    data = {**TW.target_identity(_TARGET.value), **{n: f[n].value for n in _DATA_FLAGS}}
    training = {"arch": _ARCH.value, "seq_len": _SEQ.value, "val_sequences": _VAL.value,
                **{n: f[n].value for n in _SHAPE_FLAGS[_ARCH.value]},
                **{TrainConfig.FLAG_NAMES.get(n, n): getattr(tc, n) for n in _RECIPE}}
    return data, training


def check_flags(tc: TrainConfig) -> None:
    """Numbers that cannot work, refused before any work."""
    for name in ("steps", "train_batch", "log_every", "eval_every", "ckpt_every", "eval_k", "gen_tokens",
                 "gen_batch", "seq_len", "val_sequences"):
        if flags.FLAGS[name].value < 1:
            raise app.UsageError(f"--{name} must be at least 1 (got {flags.FLAGS[name].value})")
    if not np.isfinite(tc.lr) or tc.lr <= 0:
        raise app.UsageError(f"--lr must be a positive number (got {tc.lr})")
    if 0 < _NUM_DATA.value < TD.MIN_SEQUENCES:
        raise app.UsageError(f"--num_data_prompts={_NUM_DATA.value}: training needs at least {TD.MIN_SEQUENCES} "
                             f"data prompts (a quarter of the sequences is held out for evaluation)")


def diverged_hint(tc: TrainConfig) -> str:
    default = flags.FLAGS["lr"].default
    if tc.lr > 10 * default:
        return f"likely cause: --lr={tc.lr:g} is {tc.lr / default:.0f}x the default {default:g}"
    return f"likely cause: the learning rate --lr={tc.lr:g} or --clip={tc.clip:g} is too large for these data"


def load_data(target, work: pathlib.Path):
    """(sequences, prompt lengths, seconds, messages): the cached or newly generated data."""
    t0 = time.perf_counter()
    messages = TD.data_messages(mtbench_from=_MT_FROM.value, humaneval_from=_HE_FROM.value,
                                package_prompts=_PKG.value, chat_prompts=_CHAT.value)
    if _NUM_DATA.value:
        messages = messages[: _NUM_DATA.value]
    C.log(f"data: {len(messages)} prompts, {_GEN_TOKENS.value} new tokens each at most")
    seqs, plens = TD.generate_data(target, messages, work / "data", _GEN_TOKENS.value, _GEN_BATCH.value,
                                   _DATA_SECONDS.value)
    return seqs, plens, time.perf_counter() - t0, messages


def n_held_out(n: int) -> int:
    hint = ("raise --num_data_prompts or --package_prompts, or --data_seconds" if _DATA_SECONDS.value
            else "raise --num_data_prompts or --package_prompts")
    return TD.split_sizes(n, _VAL.value, hint)


def log_step_cost(cost: dict) -> None:
    C.log(f"step cost (batch 1, context {cost['context']}): draft {cost['draft_bytes'] / 1e6:.1f} MB, "
          f"{cost['draft_step_ms']:.2f} ms; target {cost['target_bytes'] / 1e6:.1f} MB, "
          f"{cost['target_step_ms']:.2f} ms; ratio bytes {cost['bytes_ratio']:.3f}, time {cost['time_ratio']:.3f}")


def finish(summary: dict, work: pathlib.Path, k: int, t_start: float) -> None:
    rows = [json.loads(line) for line in open(work / "metrics.jsonl")]
    summary["evals"] = [r for r in rows if "eval" in r]
    summary["wall_seconds_this_process"] = time.perf_counter() - t_start
    _paths.write_text(work / "summary.json", json.dumps(C.jsonable(summary), indent=1))


def exporting(work: pathlib.Path) -> None:
    _paths.set_status(lambda: f"training had finished; exporting; the checkpoint is in {work / 'ckpt'}, from "
                      f"which the same command exports again")


# --- main -------------------------------------------------------------------------------------

def main_feature(target, out_dir: pathlib.Path, work: pathlib.Path, t_start: float, tc: TrainConfig):
    """--arch=feature: data, the target's features on it, training, export (see _feature_distill)."""
    import jax
    from specjax.models import feature_draft, quant

    summary = {"target": _TARGET.value, "arch": "feature", "argv": sys.argv, "machine": C.machine()}
    seqs, plens, data_seconds, messages = load_data(target, work)
    n_val = n_held_out(len(seqs))  # held out: greedy continuations only
    tokens, _ = TD.pack(seqs, plens, _SEQ.value)  # [N, T]: the prompt cropped from the left
    lengths = [min(len(s), _SEQ.value + 1) for s in seqs]
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
                     make_optimizer=TM.make_optimizer, noise=_FEAT_NOISE.value, reg_weight=_FEAT_WEIGHT.value,
                     soft=_SOFT.value, chained=_CHAINED.value, diverged_hint=diverged_hint(tc),
                     **dataclasses.asdict(tc))
    if final is None:
        return
    summary["train_seconds_this_process"] = time.perf_counter() - t0
    exporting(work)
    draft = feature_draft.FeatureDraft(cfg, jax.device_get(final), ids, out_dir.name, _TARGET.value)
    if _FEAT_INT8.value:
        draft = feature_draft.quantize(draft)
    TW.export_checked(out_dir, lambda d: feature_draft.save(draft, d, extra={"trained_for": _TARGET.value}),
                      TW.verify_feature_draft, work)
    if _TIMING.value:
        cost = FD.step_cost(target, feature_draft.load(out_dir), _TIMING.value)
        log_step_cost(cost)
        summary["step_cost"] = cost
    TM.plot_curve(work, work / "loss_curve.png", tc.k)
    finish(summary, work, tc.k, t_start)
    C.log(f"wrote {out_dir}: loaded back and checked (specjax.models.feature_draft.load opens it; --draft {out_dir} "
          f"in the binaries); curve {work / 'loss_curve.png'}, summary {work / 'summary.json'}")


def main_model(target, out_dir: pathlib.Path, work: pathlib.Path, t_start: float, tc: TrainConfig):
    """--arch=model: the draft's shape, its step cost, data, training, export."""
    import jax

    arch = TM.Arch(_WIDTH.value, _LAYERS.value, _HEAD_DIM.value, _KV_HEADS.value, _FFN.value)
    cfg = TM.draft_config(target.config, arch)
    train_params, frozen = TM.init_draft(target, cfg, tc.seed)
    n_train = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(train_params))
    C.log(f"draft: {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} kv, "
          f"F {cfg.intermediate_size}; {n_train / 1e6:.2f}M trainable parameters")
    summary = {"target": _TARGET.value, "arch": dataclasses.asdict(arch), "draft_config": dataclasses.asdict(cfg),
               "trainable_params": n_train, "argv": sys.argv, "machine": C.machine()}
    if _TIMING.value:
        cost = TM.step_cost(target, cfg, {**frozen, **train_params}, _TIMING.value)
        log_step_cost(cost)
        summary["step_cost"] = cost

    seqs, plens, data_seconds, messages = load_data(target, work)
    n_val = n_held_out(len(seqs))
    tokens, mask = TD.pack(seqs, plens, _SEQ.value)
    val_tokens, val_mask, tokens, mask = tokens[:n_val], mask[:n_val], tokens[n_val:], mask[n_val:]
    C.log(f"data: {len(tokens)} training sequences ({int(mask.sum())} target tokens), {n_val} held out; "
          f"{data_seconds:.0f}s")
    summary["data"] = {"prompts": len(messages), "train_sequences": len(tokens), "train_target_tokens": int(mask.sum()),
                       "val_sequences": n_val, "val_target_tokens": int(val_mask.sum()), "seconds": data_seconds}

    t0 = time.perf_counter()
    final = TM.train(cfg, train_params, frozen, tokens, mask, val_tokens, val_mask, work,
                     diverged_hint=diverged_hint(tc), **dataclasses.asdict(tc))
    if final is None:
        return
    summary["train_seconds_this_process"] = time.perf_counter() - t0
    TM.plot_curve(work, work / "loss_curve.png", tc.k)
    exporting(work)
    params = jax.device_get({**frozen, **final})
    TW.export_checked(out_dir, lambda d: TM.export(cfg, params, target.tokenizer, d),
                      lambda d: TW.verify_model_draft(d, cfg), work)
    finish(summary, work, tc.k, t_start)
    C.log(f"wrote {out_dir}: loaded back and checked (models.load opens it); curve {work / 'loss_curve.png'}, "
          f"summary {work / 'summary.json'}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    out_dir = pathlib.Path(_OUT.value)
    work = pathlib.Path(_WORK.value or str(out_dir) + ".work")
    TW.check_paths(out_dir, work)  # before any work
    tc = TrainConfig.from_flags()
    check_flags(tc)
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    work.mkdir(parents=True, exist_ok=True)
    data, training = settings(tc)
    TW.check_record(work, data=data, training=training, steps=tc.steps)
    _paths.set_status(lambda: f"the work directory {work} keeps what is done (data batches, checkpoints); the "
                      f"same command continues from there")
    t_start = time.perf_counter()
    target = C.load_model(_TARGET.value)
    (main_feature if _ARCH.value == "feature" else main_model)(target, out_dir, work, t_start, tc)


if __name__ == "__main__":
    C.run_main(main)
