"""Choosing between a compiled kernel, an interpreted kernel and the jnp reference.

Every public function in `specjax.pallas` takes `impl=None | "kernel" | "reference"`
and `interpret=None | bool`. With `impl=None` the choice comes from, in order:
`set_impl(...)`, the environment variable `SPECJAX_PALLAS` ("auto", "kernel",
"reference"), then "auto": the compiled kernel on GPU and TPU, the jnp reference
on CPU (the interpreter is slow). `interpret=None` interprets the kernel exactly
when the default backend is neither GPU nor TPU, so `SPECJAX_PALLAS=kernel` forces
the kernel everywhere, in interpret mode on CPU.

The choice is made when a function is traced: change it before calling `jax.jit`
on code that uses these functions (or clear the jit caches).
"""

from __future__ import annotations

import os

import jax

ENV_VAR = "SPECJAX_PALLAS"
_IMPLS = ("auto", "kernel", "reference")
_VARIANTS = ("mosaic", "triton")
_override: str | None = None


def set_impl(impl: str | None) -> str | None:
    """Sets the process-wide default implementation; returns the previous setting.

    `impl` is "auto", "kernel", "reference", or None (back to `$SPECJAX_PALLAS`).
    """
    global _override
    if impl is not None and impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS} or None, got {impl!r}")
    previous, _override = _override, impl
    return previous


def accelerator() -> str | None:
    """"gpu" or "tpu" when the default backend is one, else None."""
    backend = jax.default_backend()
    return backend if backend in ("gpu", "tpu") else None


def resolve_impl(impl: str | None) -> str:
    """Returns "kernel" or "reference"."""
    if impl is None:
        impl = _override or os.environ.get(ENV_VAR, "") or "auto"
        where = f"set_impl() / ${ENV_VAR}"
    else:
        where = "impl"
    if impl not in _IMPLS:
        raise ValueError(f"{where} must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "kernel" if accelerator() else "reference"
    return impl


def resolve_interpret(interpret: bool | None) -> bool:
    if interpret is None:
        return accelerator() is None
    return bool(interpret)


def resolve_variant(variant: str | None) -> str:
    """Kernel flavour: "triton" (one program per row and vocabulary split, masked
    loads; GPU) or "mosaic" (BlockSpec pipeline over a (rows, vocabulary) grid with
    the vocabulary as the reduction axis; TPU). Both run in interpret mode."""
    if variant is None:
        return "triton" if accelerator() == "gpu" else "mosaic"
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS} or None, got {variant!r}")
    return variant


def check_compiled_variant(variant: str, interpret: bool) -> None:
    """A compiled (non-interpreted) kernel needs the backend its variant lowers to."""
    if interpret:
        return
    backend = accelerator()
    if backend is None:
        raise ValueError(f"the {jax.default_backend()} backend runs Pallas kernels only in "
                         "interpret mode: pass interpret=True (or interpret=None)")
    want = "triton" if backend == "gpu" else "mosaic"
    if variant != want:
        raise ValueError(f"variant {variant!r} does not compile on {backend}; use {want!r} "
                         "(or interpret=True)")


def compiler_params(variant: str, interpret: bool, *, triton=None, mosaic=None):
    """The variant's compiler parameters (dicts of keyword arguments), None when
    interpreting. On GPU they are explicit Triton parameters: JAX's default GPU
    backend for pallas_call may be Mosaic GPU."""
    if interpret:
        return None
    if variant == "triton":
        from jax.experimental.pallas import triton as plgpu
        return plgpu.CompilerParams(**(triton or {}))
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(**(mosaic or {}))


def out_struct(shape, dtype, *likes) -> jax.ShapeDtypeStruct:
    """A pallas_call output type varying over the manual mesh axes of its inputs `likes`,
    so the kernels also run inside a `jax.shard_map` that checks them (check_vma=True).

    Uses the widest input type when it covers the others (outside shard_map they are
    all empty); otherwise leaves the type unset.
    """
    mats = [getattr(jax.typeof(x), "manual_axis_type", None) for x in likes]
    widest = max(mats, key=lambda m: len(getattr(m, "varying", ())))
    if widest is not None and all(
        m is not None and set(m.varying) <= set(widest.varying) for m in mats):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=widest)
    return jax.ShapeDtypeStruct(shape, dtype)
