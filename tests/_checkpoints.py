"""Tiny random checkpoints written by the tests themselves: an HF safetensors directory and a
GGUF file (block-quantized layers, llama.cpp's RoPE row order, a byte-level BPE vocabulary)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

# Every sharded dimension divides 8 (heads 16 / kv heads 8, mlp, vocab) and every GGUF row is
# whole Q8_0 blocks per shard of 8 (inputs are whole 256-wide K-quant super-blocks too): a (1, 8)
# mesh splits each layer weight in eight.
SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=16,
             num_kv_heads=8, head_dim=16)


def _tensors(seed: int, shape=SHAPE, tie=False, bias=False) -> dict[str, np.ndarray]:
    """transformers' names and [out, in] layout, float32."""
    rng = np.random.default_rng(seed)
    D, F, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    Hd, Gd = shape["num_heads"] * shape["head_dim"], shape["num_kv_heads"] * shape["head_dim"]
    w = lambda *s: (rng.standard_normal(s) * 0.08).astype(np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D)}
    if not tie:
        out["lm_head.weight"] = w(V, D)
    for i in range(shape["num_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": w(Hd, D), p + "self_attn.k_proj.weight": w(Gd, D),
                    p + "self_attn.v_proj.weight": w(Gd, D), p + "self_attn.o_proj.weight": w(D, Hd),
                    p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
                    p + "mlp.down_proj.weight": w(D, F), p + "input_layernorm.weight": 1 + w(D),
                    p + "post_attention_layernorm.weight": 1 + w(D)})
        if bias:
            out.update({p + "self_attn.q_proj.bias": w(Hd), p + "self_attn.k_proj.bias": w(Gd),
                        p + "self_attn.v_proj.bias": w(Gd)})
    return out


def write_hf(path, *, seed=0, shape=SHAPE, tie=False, qwen2=False, dtype="float32", max_shard_bytes=None):
    """A transformers-style directory: config.json and model.safetensors (or shards and an index)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
           "model_type": "qwen2" if qwen2 else "llama", "vocab_size": shape["vocab_size"],
           "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
           "num_hidden_layers": shape["num_layers"], "num_attention_heads": shape["num_heads"],
           "num_key_value_heads": shape["num_kv_heads"], "head_dim": shape["head_dim"],
           "rope_theta": 500.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
           "tie_word_embeddings": tie, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(cfg))
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = {k: v.astype(np_dtype) for k, v in _tensors(seed, shape, tie, bias=qwen2).items()}
    if max_shard_bytes is None:
        save_file(tensors, path / "model.safetensors")
        return path
    shards, current, size = [], {}, 0
    for k, v in tensors.items():
        if current and size + v.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k], size = v, size + v.nbytes
    shards.append(current)
    weight_map = {}
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, path / name)
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _bytes_to_unicode():
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _rope_permute(w, heads):
    """llama.cpp's converter order: each head's two halves interleaved (what we undo on load)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, *, seed=0, shape=SHAPE, tie=False, layer_types=None):
    """A llama GGUF: layer weights in `layer_types` (gguf type names, cycled over the weights;
    default Q8_0), embedding F16, head Q8_0, norms F32; random K-quant blocks for Q4_K / Q6_K
    (the gguf package quantizes only the legacy types)."""
    import gguf

    T = gguf.GGMLQuantizationType
    types = [T[n] for n in (layer_types or ["Q8_0"])]
    rng = np.random.default_rng(seed + 1)
    tensors = _tensors(seed, shape, tie)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {v: k for k, v in {
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight"}.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    V = shape["vocab_size"]
    w.add_block_count(shape["num_layers"])
    w.add_context_length(512)
    w.add_embedding_length(shape["hidden_size"])
    w.add_feed_forward_length(shape["intermediate_size"])
    w.add_head_count(shape["num_heads"])
    w.add_head_count_kv(shape["num_kv_heads"])
    w.add_key_length(shape["head_dim"])
    w.add_value_length(shape["head_dim"])
    w.add_rope_dimension_count(shape["head_dim"])
    w.add_rope_freq_base(500.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    # bytes, one merge, and ChatML's control tokens (a chat prompt encodes)
    w.add_token_list(_bytes_to_unicode() + ["Ġt", "<|im_start|>", "<|im_end|>"]
                     + [f"<x{i}>" for i in range(V - 259)])
    w.add_token_types([1] * 257 + [3, 3] + [1] * (V - 259))
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(2)
    k = 0
    for hf, x in tensors.items():
        if hf in names:
            name = names[hf]
        else:
            i, rest = hf.split(".")[2], ".".join(hf.split(".")[3:])
            name = f"blk.{i}.{layer[rest]}"
        if name.endswith("attn_q.weight"):
            x = _rope_permute(x, shape["num_heads"])
        elif name.endswith("attn_k.weight"):
            x = _rope_permute(x, shape["num_kv_heads"])
        if x.ndim == 1:
            w.add_tensor(name, x)
        elif name == "token_embd.weight":
            w.add_tensor(name, x.astype(np.float16))
        else:
            qtype = T.Q8_0 if not name.startswith("blk.") else types[k % len(types)]
            k += name.startswith("blk.")
            if qtype in (T.Q4_K, T.Q6_K):
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
                scale_bytes = (0, 4) if qtype == T.Q4_K else (size - 2, size)  # modest float16 d, dmin
                blocks = raw.reshape(-1, size)
                n = (scale_bytes[1] - scale_bytes[0]) // 2
                blocks[:, scale_bytes[0]:scale_bytes[1]] = np.full(n, 0.01, np.float16).view(np.uint8)
                w.add_tensor(name, raw, raw_dtype=qtype)
            elif qtype in (T.F32, T.F16):
                w.add_tensor(name, x.astype(np.float32 if qtype == T.F32 else np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return pathlib.Path(path)
