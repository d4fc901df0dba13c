"""The Llama-family decoder (Llama 1-3, SmolLM2, Qwen2) as Flax Linen modules.

The modules only define parameters and the computation; they are run as pure
functions, `Transformer(config).apply({"params": params}, ...)`, inside jit.
Layers are stacked on a leading axis and run with `nn.scan`, so compile time
does not grow with depth and the KV cache is one array per K and V (a tree of
`unstack_layers` runs them in a Python loop instead, one float array per layer:
faster on XLA:CPU, see there):

    cache_k_NBSGDh, cache_v_NBSGDh, lengths_B

Attention masks keys by position only (key j is visible to a query at
position p iff j <= p), so rejected draft tokens never need erasing: the next
write simply overwrites them, and a row's length pointer is its truth.

A forward either writes its new keys and values into the cache as it goes
(`forward_cached`), or reads the cache only and returns them (`write=False`, a
`NewKV`) for the caller to write once with `write_kv`: inside the branches of a
`lax.switch` or `lax.cond` an in-place write makes XLA copy the whole cache into
each branch, a deferred one writes a few positions after the branches join.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.backend import PLAIN, Backend
from specjax.models import quant
from specjax.models.config import Config, RopeScaling

_init = nn.initializers.normal(0.02)


def _weight(module: nn.Module, name: str, shape):
    """A parameter that may be stored block-quantized (`quant.BlockQuant`).

    `self.param` checks the stored value against the initializer's shape, which a
    quantized weight (codes + scales) does not have, so stored values are read directly.
    """
    if module.has_variable("params", name) and not module.is_initializing():
        return module.get_variable("params", name)
    return module.param(name, _init, shape, jnp.float32)


class KVCache(NamedTuple):
    """Preallocated per-layer keys and values and the committed length of each row."""

    k: jax.Array  # [N, B, S, G, Dh]: N layers
    v: jax.Array  # [N, B, S, G, Dh]
    lengths: jax.Array  # int32[B]: positions >= lengths[b] are not (yet) valid for row b


def init_cache(config: Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


class NewKV(NamedTuple):
    """The keys and values of a forward's T fed tokens, not yet in the cache (`forward_cached(..., write=False)`)."""

    k: jax.Array  # [N, B, T, G, Dh], the cache's dtype
    v: jax.Array  # [N, B, T, G, Dh]


def write_kv(cache: KVCache, new: NewKV, count=None) -> KVCache:
    """`cache` with `new` written at each row's positions lengths[b] .. lengths[b] + T - 1 (the
    first `count` of them when given: the rest, padding, are not written); lengths unchanged.
    The same cache as the forward that computed `new` would have written in place."""
    _, B, T = new.k.shape[:3]
    S = cache.k.shape[2]
    t_T = jnp.arange(T, dtype=jnp.int32)
    pos_BT = cache.lengths[:, None] + t_T[None]
    if count is not None:
        pos_BT = jnp.where(t_T[None] < count, pos_BT, S)  # S: dropped
    rows_B1 = jnp.arange(B)[:, None]
    k = cache.k.at[:, rows_B1, pos_BT].set(new.k.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, rows_B1, pos_BT].set(new.v.astype(cache.v.dtype), mode="drop")
    return KVCache(k, v, cache.lengths)


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x, layer=None):
        if layer is None:
            scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        else:  # Block.stacked: the stack of every layer's scale, this one's picked
            scale = quant.layer_of(self.get_variable("params", "scale"), layer)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(_row_sum(x32 * x32) * (1.0 / x.shape[-1]) + self.eps)
        return (scale.astype(jnp.float32) * y).astype(x.dtype)


def _row_sum(a):
    """Sum over the last axis in an order fixed by D alone (elementwise adds of slices).

    XLA:CPU reduces a row in another order once there are 9 or more rows (T >= 9: a K = 8
    verify pass), so a position's norm differed in its last bits between the decode and the
    verify programs; the int8 activations of the q8 path turn such a bit into another code
    and exact speculation parted from target-only decoding. Adds of slices are exactly rounded
    wherever they run, so every row gets the same bits whatever the batch or T.
    """
    D = a.shape[-1]
    width = 64 if D % 64 == 0 else D
    s = a[..., :width]
    for i in range(width, D, width):  # chunks of 64 in order, then halves
        s = s + a[..., i:i + width]
    while s.shape[-1] % 2 == 0:
        h = s.shape[-1] // 2
        s = s[..., :h] + s[..., h:]
    return s if s.shape[-1] == 1 else jnp.sum(s, axis=-1, keepdims=True)


def rope_inv_freq(config: Config) -> np.ndarray:
    """RoPE inverse frequencies, float32[Dh / 2], computed as transformers does: base
    rope_theta, Llama 3.1's `rope_scaling`, then a GGUF's per-frequency `rope_freq_factors`."""
    Dh = config.head_dim
    exponents = np.arange(0, Dh, 2, dtype=np.int64).astype(np.float32) / np.float32(Dh)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    if config.rope_freq_factors is not None:
        inv_freq = (inv_freq / np.asarray(config.rope_freq_factors, np.float32)).astype(np.float32)
    return inv_freq


def _llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Smoothly interpolates between scaled low and unscaled high frequencies
    # (Llama 3.1 report, as implemented by transformers' _compute_llama3_parameters).
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def check_positions(fn: str, config: Config, used: int, what: str) -> None:
    """Warns when `used` positions pass the model's max_position_embeddings: RoPE was never trained
    there (`Model.logits` and the Engine check before running)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and used > limit:
        warnings.warn(f"{fn}: {what} = {used} positions, more than the model's max_position_embeddings "
                      f"{limit}; positions past it were never trained, so the output there may be meaningless",
                      stacklevel=3)


def apply_rope(x_BTHDh, positions_BT, inv_freq):
    """Rotary embedding in transformers' half-split layout (rotate_half); inv_freq: f32[Dh / 2]."""
    freqs = positions_BT[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dh / 2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x = x_BTHDh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHDh.dtype)


class Block(nn.Module):
    """One decoder layer; scanned over layers by `Transformer`.

    stacked: the parameters arrive as the whole stack of layers (a scan that broadcasts them)
    and `layer` picks this one's, so that the native kernel reads a stacked PackedQuant where it
    lies; a scan's own slicing would copy every layer's weights each step (quant.contract).
    backend: the matmul path and attention kernel (`specjax.backend.Backend`; None: XLA's).
    """

    config: Config
    dtype: Any = jnp.float32
    stacked: bool = False
    backend: Backend | None = None

    @nn.compact
    def __call__(self, carry, layer, positions_BT, write_pos_BT, stack_kv=None):
        """carry: (x, the cache's keys and values [N, B, S, G, Dh] or None), the cache written at
        `write_pos_BT` in place; or, with `stack_kv` (the cache's keys and values [N, B, S, G, Dh],
        read only: a deferred write), carry's cache is None and the layer's new keys and values
        are its second output (else None)."""
        c = self.config
        x_BTD, cache_k, cache_v = carry
        D, H, G, Dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        B, T, _ = x_BTD.shape
        # a weight may be a float array or a block-quantized one (quant.contract: XLA's dot of
        # its dequantization, or the backend's native kernel for decode-sized products)
        backend = self.backend or PLAIN
        at = layer if self.stacked else None
        w = lambda name, shape: _weight(self, name, shape)  # noqa: E731
        p = lambda name, shape: quant.materialize(  # noqa: E731
            w(name, shape) if at is None else quant.layer_of(w(name, shape), at), self.dtype)
        mm = lambda spec, x, name, shape, n_in=1: quant.contract(spec, x, w(name, shape), n_in,  # noqa: E731
                                                                 self.dtype, at, backend)

        h_BTD = RMSNorm(c.rms_norm_eps, name="attn_norm")(x_BTD, at)
        q_BTHDh = mm("btd,dhk->bthk", h_BTD, "wq", (D, H, Dh))
        k_BTGDh = mm("btd,dgk->btgk", h_BTD, "wk", (D, G, Dh))
        v_BTGDh = mm("btd,dgk->btgk", h_BTD, "wv", (D, G, Dh))
        if c.qkv_bias:
            q_BTHDh += p("bq", (H, Dh))
            k_BTGDh += p("bk", (G, Dh))
            v_BTGDh += p("bv", (G, Dh))
        inv_freq = jnp.asarray(rope_inv_freq(c))
        q_BTHDh = apply_rope(q_BTHDh, positions_BT, inv_freq)
        k_BTGDh = apply_rope(k_BTGDh, positions_BT, inv_freq)

        rows_B1 = jnp.arange(B)[:, None]
        new_kv = None
        deferred = None
        if stack_kv is not None:  # deferred: the same keys as an in-place write, the cache only read
            new_kv = (k_BTGDh.astype(stack_kv[0].dtype), v_BTGDh.astype(stack_kv[1].dtype))
            if backend.native_attention and backend.kernels.attention_supported(q_BTHDh, stack_kv[0]):
                stack_k, stack_v, at_layer, deferred = stack_kv[0], stack_kv[1], layer, new_kv  # no copy at all
            else:  # XLA: the new keys in this layer's copy
                keys_BSGDh = stack_kv[0][layer].at[rows_B1, write_pos_BT].set(new_kv[0], mode="drop")
                values_BSGDh = stack_kv[1][layer].at[rows_B1, write_pos_BT].set(new_kv[1], mode="drop")
                stack_k = None
        elif cache_k is None:  # full forward: attend over this call's tokens only
            keys_BSGDh, values_BSGDh = k_BTGDh, v_BTGDh
            stack_k = None
        else:  # write at each row's own offset, in place in the carried cache
            cache_k = cache_k.at[layer, rows_B1, write_pos_BT].set(k_BTGDh.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[layer, rows_B1, write_pos_BT].set(v_BTGDh.astype(cache_v.dtype), mode="drop")
            keys_BSGDh, values_BSGDh = cache_k[layer], cache_v[layer]
            stack_k, stack_v, at_layer = cache_k, cache_v, layer
        if stack_k is not None and backend.native_attention and backend.kernels.attention_supported(q_BTHDh, stack_k):
            # each query over its visible keys only, the stack read in place (no copy of the layer)
            attn_BTHDh = backend.kernels.attention(q_BTHDh, stack_k, stack_v, at_layer, positions_BT, deferred)
        else:
            S = keys_BSGDh.shape[1]
            q_BTGQDh = q_BTHDh.reshape(B, T, G, H // G, Dh)
            scores = jnp.einsum("btgqk,bsgk->bgqts", q_BTGQDh, keys_BSGDh.astype(self.dtype),
                                preferred_element_type=jnp.float32) * (Dh ** -0.5)
            visible_BTS = jnp.arange(S)[None, None, :] <= positions_BT[:, :, None]
            scores = jnp.where(visible_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
            attn_BTHDh = jnp.einsum("bgqts,bsgk->btgqk", probs, values_BSGDh.astype(self.dtype)).reshape(B, T, H, Dh)
        x_BTD = x_BTD + mm("bthk,hkd->btd", attn_BTHDh, "wo", (H, Dh, D), 2)

        h_BTD = RMSNorm(c.rms_norm_eps, name="mlp_norm")(x_BTD, at)
        gate_BTF = mm("btd,df->btf", h_BTD, "w_gate", (D, c.intermediate_size))
        up_BTF = mm("btd,df->btf", h_BTD, "w_up", (D, c.intermediate_size))
        x_BTD = x_BTD + mm("btf,fd->btd", nn.silu(gate_BTF) * up_BTF, "w_down", (c.intermediate_size, D))
        return (x_BTD, cache_k, cache_v), new_kv


class Transformer(nn.Module):
    """tokens -> logits, optionally reading and writing a KV cache.

    Parameter tree (layers stacked on axis 0):
      embed [D, V]; layers/{attn_norm,mlp_norm}/scale [L, D]; layers/wq [L, D, H, Dh];
      layers/wk, wv [L, D, G, Dh]; layers/bq, bk, bv (Qwen2); layers/wo [L, H, Dh, D];
      layers/w_gate, w_up [L, D, F]; layers/w_down [L, F, D]; final_norm/scale [D];
      lm_head [D, V] (untied only).
    """

    config: Config
    dtype: Any = jnp.float32
    unrolled: bool = False  # layers as `layer_0` .. `layer_{N-1}` (unstack_layers), a loop instead of a scan
    backend: Backend | None = None  # the matmul path, head chunking and attention kernel (None: XLA's)

    def _packed_stack(self) -> bool:
        """Stacked layers holding weights in a kernel's layout (`quant.Relaid`, packed by the Engine
        for the native kernel), which a native backend reads in place."""
        if self.is_initializing() or not (self.backend or PLAIN).native:
            return False
        stack = self.variables.get("params", {}).get("layers", {})
        relaid = lambda w: isinstance(w, quant.Relaid)  # noqa: E731
        return any(relaid(w) for w in jax.tree.leaves(stack, is_leaf=relaid))

    @nn.compact
    def __call__(self, tokens_BT, positions_BT, cache_kv=None, write_pos_BT=None, select_BJ=None, features=False,
                 write=True):
        """(logits, the cache's (keys, values) written, or with write=False the new ones (`NewKV`)
        [, the last layer's features when `features`])."""
        c = self.config
        # Stored [D, V], the LM head's layout: the tied head reads the whole table every
        # step (measured 1.5x faster than contracting a [V, D] table on CPU); the lookup
        # only gathers a few columns.
        # A block-quantized table (the GGUF's own codes) is read a chunk of columns at a time.
        embed_DV = _weight(self, "embed", (c.hidden_size, c.vocab_size))
        x_BTD = embed_tokens(embed_DV, tokens_BT, self.dtype)
        if not isinstance(embed_DV, quant.BlockQuant):
            embed_DV = embed_DV.astype(self.dtype)
        cache_k, cache_v = cache_kv if cache_kv is not None else (None, None)
        # a deferred write reads the cache as a loop-invariant input, never carried (a carried cache
        # that a branch does not own would be copied into the loop), each layer where it lies
        stack_kv, new_kv = (None, None) if write else ((cache_k, cache_v), None)
        if stack_kv is not None:
            cache_k = cache_v = None
        if self.unrolled:
            carry, per_layer = (x_BTD, cache_k, cache_v), []
            for i in range(c.num_layers):
                carry, kv = Block(c, self.dtype, backend=self.backend, name=f"layer_{i}")(
                    carry, i, positions_BT, write_pos_BT, stack_kv)
                per_layer.append(kv)
            x_BTD, cache_k, cache_v = carry
            if stack_kv is not None:
                new_kv = NewKV(jnp.stack([kv[0] for kv in per_layer]), jnp.stack([kv[1] for kv in per_layer]))
        elif self._packed_stack():  # the stack read in place by the native kernel (Block.stacked)
            layers = nn.scan(Block, variable_broadcast="params", split_rngs={"params": False},
                             in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_layers)(
                c, self.dtype, stacked=True, backend=self.backend, name="layers")
        else:
            layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                             in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_layers)(
                c, self.dtype, backend=self.backend, name="layers")
        if not self.unrolled:
            (x_BTD, cache_k, cache_v), kv = layers((x_BTD, cache_k, cache_v), jnp.arange(c.num_layers),
                                                   positions_BT, write_pos_BT, stack_kv)
            new_kv = None if stack_kv is None else NewKV(*kv)
        features_BTD = x_BTD  # the last layer's output at every position (a feature draft reads it)
        if select_BJ is not None:  # only these positions need logits (prefill: each row's last)
            x_BTD = jnp.take_along_axis(x_BTD, select_BJ[:, :, None], axis=1)
        x_BTD = RMSNorm(c.rms_norm_eps, name="final_norm")(x_BTD)
        # float or block-quantized alike, a vocabulary chunk at a time (see quant.matmul_columns)
        head_DV = embed_DV if c.tie_embeddings else _weight(self, "lm_head", (c.hidden_size, c.vocab_size))
        if self.has_variable("params", "head_tiles"):  # the head's codes in the native kernel's order
            head_DV = self.get_variable("params", "head_tiles")
        logits_BTV = quant.matmul_columns(x_BTD, head_DV, self.dtype, backend=self.backend)
        if c.vocab_used is not None and c.vocab_used < c.vocab_size:  # padding ids are never chosen
            real_V = jnp.arange(c.vocab_size) < c.vocab_used
            logits_BTV = jnp.where(real_V, logits_BTV, -jnp.inf)
        # float32 where the logits leave the model: the rules' gates, entropies and ledgers
        # are computed in float32 whatever the compute dtype (docs/rules.md)
        kv_out = (cache_k, cache_v) if new_kv is None else new_kv
        if features:
            return logits_BTV.astype(jnp.float32), kv_out, features_BTD
        return logits_BTV.astype(jnp.float32), kv_out


def embed_tokens(embed_DV, tokens_BT, dtype=jnp.float32):
    """Token embeddings [B, T, D] from a [D, V] table, float or block-quantized (a few columns
    are gathered, never the whole table dequantized)."""
    if isinstance(embed_DV, quant.BlockQuant):
        return quant.take_columns(embed_DV, tokens_BT, dtype)
    return jnp.moveaxis(jnp.take(embed_DV.astype(dtype), tokens_BT, axis=1), 0, -1)


def forward(config: Config, params, tokens_BT, *, dtype=jnp.float32, backend=None):
    """Full causal forward without a cache: float32[B, T, V] at positions 0..T-1.

    backend (here and below): the matmul path, head chunking and attention kernel
    (`specjax.backend.Backend`); None is XLA's dot, the head chunked on an unsharded CPU."""
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _ = Transformer(config, dtype, is_unrolled(params), backend).apply({"params": params}, tokens_BT, positions_BT)
    return logits


def forward_cached(config: Config, params, tokens_BT, cache: KVCache, *, dtype=jnp.float32, select_BJ=None,
                   backend=None, write=True):
    """Scores T new tokens per row at positions lengths[b] .. lengths[b]+T-1.

    Writes their keys and values into the cache but does not advance `lengths`:
    the caller commits by moving the length pointer (by the number of tokens it
    keeps), so a rejected suffix is forgotten without being erased.
    `select_BJ` (int32[B, J], indices into T) computes logits only at those
    positions. Returns (logits float32[B, T or J, V], cache with the new keys/values written);
    write=False: (logits, the new keys and values, a `NewKV` for `write_kv`), the cache only read
    (the same logits, bit for bit).
    """
    B, T = tokens_BT.shape
    positions_BT = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    logits, kv = Transformer(config, dtype, is_unrolled(params), backend).apply(
        {"params": params}, tokens_BT, positions_BT, (cache.k, cache.v), positions_BT, select_BJ, write=write)
    return logits, (KVCache(*kv, cache.lengths) if write else kv)


def forward_features(config: Config, params, tokens_BT, cache: KVCache | None = None, *, dtype=jnp.float32,
                     select_BJ=None, backend=None, write=True):
    """`forward` (cache None) or `forward_cached`, also returning the last layer's output before
    the final norm at every fed position: (logits, features [B, T, D] in `dtype`, cache or None;
    with write=False the `NewKV` in its place). The target's features are what a feature draft
    (`specjax.models.feature_draft`) reads."""
    B, T = tokens_BT.shape
    if cache is None:
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        logits, _, feats = Transformer(config, dtype, is_unrolled(params), backend).apply(
            {"params": params}, tokens_BT, positions_BT, select_BJ=select_BJ, features=True)
        return logits, feats, None
    positions_BT = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    logits, kv, feats = Transformer(config, dtype, is_unrolled(params), backend).apply(
        {"params": params}, tokens_BT, positions_BT, (cache.k, cache.v), positions_BT, select_BJ, True, write)
    return logits, feats, (KVCache(*kv, cache.lengths) if write else kv)


def is_unrolled(params) -> bool:
    """Whether `params` hold one tree per layer (`unstack_layers`) rather than stacked layers."""
    return "layer_0" in params


def unstack_layers(params, dtype=jnp.float32):
    """`params` with the stacked `layers` split into `layer_0` .. `layer_{N-1}`; block-quantized
    matrices become float arrays of `dtype`, the compute dtype (the values the forward computes
    from the codes); float ones keep their dtype. XLA fuses a loop of layers differently from a
    scan, so a logit may move by an ulp (SmolLM2's decode step: bit for bit the same).

    Why: on XLA:CPU a scan over stacked weights copies each layer's slice into a new buffer before
    its dot, and block codes are dequantized into a float buffer that the dot then reads (XLA:CPU
    cannot fuse the two); separate float arrays are read by the dot where they lie. Measured on a
    2-core Xeon (experiments/profile_step.py): SmolLM2-135M's decode step 1.4x faster. The cost:
    compile time grows with depth, and the weights take float bytes (3.2x a Q4_1 file's codes).
    `native.PackedQuant` matrices (made for the native CPU kernel) stay packed, one per layer: the
    kernel streams them where they lie, with no slice copied per step.
    """
    if is_unrolled(params):
        return params
    dtype = jnp.dtype(dtype)

    def layer(i):
        def one(x):
            if isinstance(x, quant.BlockQuant):
                return quant.BlockQuant(x.codes[i], x.scale[i], None if x.offset is None else x.offset[i],
                                        x.shape).dequantize(dtype)
            if isinstance(x, quant.Relaid):  # made for the native kernel, read in place
                return jax.tree.map(lambda a: jnp.array(a[i]), x)
            return jnp.asarray(x[i])  # float weights keep the dtype they are stored in
        return jax.tree.map(one, params["layers"], is_leaf=quant.is_quantized)

    n = jax.tree.leaves(params["layers"], is_leaf=quant.is_quantized)[0]
    n = (n.codes if isinstance(n, quant.BlockQuant) else n.data if quant.is_quantized(n) else n).shape[0]
    out = {k: v for k, v in params.items() if k != "layers"}
    out.update({f"layer_{i}": jax.block_until_ready(layer(i)) for i in range(n)})
    return out


def init_params(config: Config, seed: int = 0, dtype=jnp.float32):
    """Random parameters of the right shapes (tiny test models, random real-shape checks),
    stored in `dtype` (the cast is inside the jit: no float32 copy of the tree is kept)."""
    tokens = jnp.zeros((1, 1), jnp.int32)

    def init(key):  # eager Linen init of a scanned stack is slow
        return cast_params(Transformer(config).init(key, tokens, tokens)["params"], dtype)

    return jax.jit(init)(jax.random.PRNGKey(seed))


def param_shapes(config: Config, dtype=jnp.float32):
    """The parameter tree as `jax.ShapeDtypeStruct`s of `dtype` (nothing is allocated)."""
    return jax.eval_shape(lambda: init_params(config, 0, dtype))


def cast_params(params, dtype):
    """Float arrays of `params` in `dtype`; block-quantized weights stay as they are (their
    codes and scales dequantize to the compute dtype inside the forward)."""
    dtype = jnp.dtype(dtype)

    def one(x):
        if isinstance(x, quant.BlockQuant) or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)  # a host array is cast on the host: no float32 copy on the device

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, quant.BlockQuant))
