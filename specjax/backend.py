"""`Backend`: every static choice of how a traced program computes, in one frozen object.

What a traced function computes depends only on its arguments: the matmul path, the LM
head's chunking, the attention kernel, the platform the Pallas kernels are chosen for
and the mesh they run on, and the vocabulary sharding of the rules' statistics are
fields here, never module-level switches or context stacks. The Engine builds one
(`Engine.backend`) from its platform, mesh and `matmul` argument; `loop.Program` holds it
and hands it to the model's forward, the drafters and the rule. Everything else takes
`backend=None`, which is `Backend()`: XLA's dot, the head in one dot (or in chunks on an
unsharded CPU, see `head_chunk`), the Pallas kernels chosen for the default platform,
one device. A Backend is plain data on the traced path: every choice is a field, resolved
when it is built (the Engine resolves the Pallas ones for its platform), and no function of
this module runs while a program is traced.

This module is the bottom layer of specjax: it imports nothing of specjax, so every
layer (pallas < verify < models < native < sharding < drafters < loop < engine; see
tests/test_layering.py) may read it.

    backend = Backend(matmul="native", kernels=native, native_attention=True, head_chunk=1024)
    logits = llama.forward_cached(config, params, tokens_BT, cache, backend=backend)
    verdict = verify.fly(drafts_K, logits_RV, backend=Backend(vocab_sharding=VocabSharding(mesh)))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

MATMULS = ("xla", "native", "q8")
PALLAS_IMPLS = ("auto", "kernel", "reference")
PALLAS_VARIANTS = ("mosaic", "triton")
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class VocabSharding:
    """Target logits sharded over the vocabulary on `mesh` axis (or axes) `vocab_axis`.

    Each device then reduces its slice of V and the devices exchange 8 floats per
    row (`pallas.gate_stats_sharded`); no device gathers whole rows of logits.
    batch_axis: the mesh axis (or axes) the batch of rows is sharded on (e.g. "data"), passed
    to the rules' vmaps as `spmd_axis_name` so rows stay on their devices;
    it needs Auto mesh axes. With None (the default) the batch is replicated
    across the other mesh axes for the statistics (correct, more traffic).
    """

    mesh: jax.sharding.Mesh
    vocab_axis: str | tuple[str, ...] = "model"
    batch_axis: str | tuple[str, ...] | None = None

    def __post_init__(self):
        names = {}
        for field in ("vocab_axis", "batch_axis"):
            axes = getattr(self, field)
            names[field] = set(axes if isinstance(axes, tuple) else () if axes is None else (axes,))
            for axis in names[field]:
                if axis not in self.mesh.axis_names:
                    raise ValueError(f"VocabSharding: {field} {axis!r} is not an axis of the mesh "
                                     f"{self.mesh.axis_names}")
        if not names["vocab_axis"]:
            raise ValueError("VocabSharding: vocab_axis names no mesh axis")
        if shared := names["vocab_axis"] & names["batch_axis"]:
            raise ValueError(f"VocabSharding: batch_axis and vocab_axis share {sorted(shared)}")
        if names["batch_axis"] and jax.sharding.AxisType.Explicit in self.mesh.axis_types:
            raise ValueError("VocabSharding: batch_axis needs a mesh with Auto axis types (jax.make_mesh(..., "
                             "axis_types=(AxisType.Auto,) * n)); on Explicit axes leave batch_axis=None")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
    """The static settings of a traced program (hashable: a field of `loop.Program`, a static
    argument of `jax.jit`).

    matmul: "xla" (XLA's dot of the materialized weight), "native" (decode-sized products,
        B x T <= `native_max_rows`, in `kernels`' dot, which reads block codes in registers) or
        "q8" (as "native"; weights the Engine packed as int8-activation tiles run there at every
        size). Not "xla" needs `kernels`.
    kernels: the native kernel library, an object with `dot(x_MK, w, layer)`, `supports(x, w,
        stacked)`, `attention(...)` and `attention_supported(q, cache_k)` (`specjax.native`,
        which the Engine passes; the models never import it). None with matmul "xla".
    native_attention: cached attention in `kernels.attention` (each query over its visible keys,
        the cache read in place). The Engine turns it on exactly when the matmuls are native
        ("auto" on an unsharded CPU, "native", "q8"): its polynomial exponential is not XLA's,
        which the float32 rounding of the native dots already gives up.
    head_chunk: vocabulary columns per step of the LM head's scan (`quant.matmul_columns`);
        0 is one whole dot; None decides from the default backend (`default_head_chunk`).
    native_max_rows: rows (B x T) up to which a matmul goes to the native kernel; a prefill's
        many rows are compute bound, where XLA's blocked dot is faster.
    pallas: "auto" (the compiled kernel on GPU/TPU, the jnp reference on CPU), "kernel"
        (interpreted on CPU) or "reference"; None reads $SPECJAX_PALLAS, else "auto". The Engine
        passes "kernel" or "reference", resolved once for its platform (`pallas.resolve_backend`),
        so a traced program never decides it again.
    interpret: whether a Pallas kernel runs in interpret mode; None: on a platform that is neither
        GPU nor TPU (resolved by the Engine too).
    variant: the Pallas kernels' flavour, "mosaic" (TPU) or "triton" (GPU); None: by platform.
    platform: the platform the program is compiled for ("cpu", "gpu", "tpu"): the Pallas
        kernels' variant and whether they are interpreted. None: the devices of the mesh in
        context (`jax.set_mesh`, a shard_map's), else the default backend. The Engine sets it
        from its mesh's devices, so a CPU host compiles Mosaic kernels for a TPU topology.
    mesh: a `jax.sharding.Mesh` on which a Pallas kernel traced outside a shard_map runs in a
        replicated one (the partitioner cannot split a Mosaic or Triton call); None: as is.
    vocab_sharding: a `VocabSharding`: the rules read vocabulary-sharded logits shard by shard
        (`pallas.gate_stats_sharded`) and vmap their rows over its batch axis; None: plain.
    """

    matmul: str = "xla"
    kernels: Any = None
    native_attention: bool = False
    head_chunk: int | None = None
    native_max_rows: int = 128
    pallas: str | None = None
    interpret: bool | None = None
    variant: str | None = None
    platform: str | None = None
    mesh: Any = None
    vocab_sharding: VocabSharding | None = None
    # whether decode-sized matmuls run in the native kernel: a field computed here, so that a traced
    # program reads plain data (no method of this module runs while tracing)
    native: bool = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "native", self.matmul != "xla")
        if self.matmul not in MATMULS:
            raise ValueError(f"Backend: matmul must be one of {MATMULS}, got {self.matmul!r}")
        if self.matmul != "xla" and self.kernels is None:
            raise ValueError(f"Backend: matmul={self.matmul!r} needs its kernels (specjax.native)")
        if self.native_attention and self.kernels is None:
            raise ValueError("Backend: native_attention needs its kernels (specjax.native)")
        if self.head_chunk is not None and (not isinstance(self.head_chunk, int) or self.head_chunk < 0):
            raise ValueError(f"Backend: head_chunk must be an int >= 0 or None, got {self.head_chunk!r}")
        if self.pallas is not None and self.pallas not in PALLAS_IMPLS:
            raise ValueError(f"Backend: pallas must be one of {PALLAS_IMPLS} or None, got {self.pallas!r}")
        if self.interpret is not None and not isinstance(self.interpret, bool):
            raise ValueError(f"Backend: interpret must be a bool or None, got {self.interpret!r}")
        if self.variant is not None and self.variant not in PALLAS_VARIANTS:
            raise ValueError(f"Backend: variant must be one of {PALLAS_VARIANTS} or None, got {self.variant!r}")
        if self.platform is not None and self.platform not in PLATFORMS:
            raise ValueError(f"Backend: platform must be 'cpu', 'gpu', 'tpu' or None, got {self.platform!r}")
        if self.vocab_sharding is not None and not isinstance(self.vocab_sharding, VocabSharding):
            raise ValueError(f"Backend: vocab_sharding must be a VocabSharding or None, got {self.vocab_sharding!r}")

    def replace(self, **changes) -> "Backend":
        return dataclasses.replace(self, **changes)


PLAIN = Backend()


def of(backend: Backend | None) -> Backend:
    """`backend`, or the plain one for None; anything else is an error naming it. For public entry
    points; code that a program traces reads `backend or PLAIN` (the Engine always passes one)."""
    if backend is None:
        return PLAIN
    if not isinstance(backend, Backend):
        raise ValueError(f"backend must be a specjax.backend.Backend or None, got {backend!r:.80}")
    return backend
