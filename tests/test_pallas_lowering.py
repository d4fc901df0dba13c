"""The kernels lower for real accelerators: Mosaic (TPU) and Triton (GPU) IR, via jax.export.

No accelerator is needed: `jax.export` runs the Pallas -> Mosaic / Triton lowering
for a named platform on the CPU. This checks block shapes, power-of-two tensor
sizes, masked loads and every op inside the kernels against the real lowerings;
what it cannot check is the backend compiler after that (Mosaic's layout passes
in libtpu, Triton -> PTX) and the numbers on the device.
"""

import sys

import jax
import jax.numpy as jnp
import pytest
from jax import export

import specjax.pallas  # noqa: F401  (module objects below; the package re-exports functions)

_gate_kernel = sys.modules["specjax.pallas._gate_kernel"]
_regret = sys.modules["specjax.pallas.regret_prefix"]

PLATFORM = {"mosaic": "tpu", "triton": "cuda"}
CUSTOM_CALL = {"mosaic": "tpu_custom_call", "triton": "__gpu$xla.gpu.triton"}


def lower(fn, args, variant):
    try:
        exp = export.export(
            jax.jit(fn), platforms=[PLATFORM[variant]],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(CUSTOM_CALL["triton"])])(*args)
    except ValueError as e:
        if "Cannot lower pallas_call on platform" in str(e):
            pytest.skip(f"this jaxlib has no {PLATFORM[variant]} Pallas lowering")
        raise
    text = exp.mlir_module()
    assert CUSTOM_CALL[variant] in text
    return text


@pytest.mark.parametrize("variant", ["mosaic", "triton"])
@pytest.mark.parametrize("N,V,dtype,splits", [
    (1, 1, jnp.float32, None),
    (7, 3, jnp.bfloat16, None),
    (23, 5000, jnp.bfloat16, None),        # partial row and vocabulary blocks
    (9, 151936, jnp.float32, 4),           # Qwen2.5 vocabulary, vocabulary splits
    (528, 49152, jnp.bfloat16, None),      # SmolLM2 vocabulary, 16 * (32 + 1) rows
])
def test_gate_kernel_lowers(variant, N, V, dtype, splits):
    x = jax.ShapeDtypeStruct((N, V), dtype)
    t = jax.ShapeDtypeStruct((N,), jnp.int32)
    lower(lambda x, t: _gate_kernel.gate_partials_kernel(
        x, t, variant=variant, block_v=_gate_kernel.DEFAULT_BLOCK_V[variant],
        block_n=_gate_kernel.DEFAULT_BLOCK_N, num_splits=splits, interpret=False),
          (x, t), variant)


@pytest.mark.parametrize("variant", ["mosaic", "triton"])
@pytest.mark.parametrize("B,K", [(1, 1), (16, 8), (300, 33)])
def test_regret_kernel_lowers(variant, B, K):
    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct((B, K), d) for d in (jnp.bool_, f32, f32)]
    args += [jax.ShapeDtypeStruct((B,), d) for d in (f32, f32, f32, jnp.int32)]
    lower(lambda *a: _regret._regret_prefix_kernel(*a, interpret=False, variant=variant),
          args, variant)
