"""Choosing between a compiled kernel, an interpreted kernel and the jnp reference.

Every public function in `specjax.pallas` takes `impl=None | "kernel" | "reference"`
and `interpret=None | bool`. With `impl=None` the choice comes from, in order:
`set_impl(...)`, the environment variable `SPECJAX_PALLAS` ("auto", "kernel",
"reference"), then "auto": the compiled kernel on GPU and TPU, the jnp reference
on CPU (the interpreter is slow). `interpret=None` interprets the kernel exactly
when the target platform is neither GPU nor TPU, so `SPECJAX_PALLAS=kernel` forces
the kernel everywhere, in interpret mode on CPU.

The platform is the one the program is compiled for (`target_platform`): the
default backend, unless `compile_for("tpu")` or a mesh of TPU devices in context
(`jax.set_mesh`, as a deviceless AOT compilation for a TPU topology does) says
otherwise; so a CPU host can compile the Mosaic kernels for a TPU.

The choice is made when a function is traced: change it before calling `jax.jit`
on code that uses these functions (or clear the jit caches).
"""

from __future__ import annotations

import contextlib
import os

import jax

ENV_VAR = "SPECJAX_PALLAS"
_IMPLS = ("auto", "kernel", "reference")
_VARIANTS = ("mosaic", "triton")
_override: str | None = None
_platform: str | None = None  # `compile_for`
_mesh = None  # `on_mesh`


def set_impl(impl: str | None) -> str | None:
    """Sets the process-wide default implementation; returns the previous setting.

    `impl` is "auto", "kernel", "reference", or None (back to `$SPECJAX_PALLAS`).
    """
    global _override
    if impl is not None and impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS} or None, got {impl!r}")
    previous, _override = _override, impl
    return previous


@contextlib.contextmanager
def compile_for(platform: str | None):
    """Within this block, kernels are chosen for `platform` ("tpu", "gpu", "cpu"; None: as
    if outside), whatever the host's backend: deviceless AOT compilation for a TPU topology
    from a CPU host traces the Mosaic variant, compiled, not interpreted."""
    global _platform
    if platform is not None and platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be 'cpu', 'gpu', 'tpu' or None, got {platform!r}")
    previous, _platform = _platform, platform
    try:
        yield
    finally:
        _platform = previous


@contextlib.contextmanager
def on_mesh(mesh):
    """Within this block, kernels traced outside a `shard_map` run inside one over `mesh`
    (a jax.sharding.Mesh; None: not), on replicated operands: the partitioner cannot split
    a Mosaic or Triton call across devices, so every device runs it on the whole (small)
    input. The engine's program enters it around the verify step on a mesh."""
    global _mesh
    previous, _mesh = _mesh, mesh
    try:
        yield
    finally:
        _mesh = previous


def run_kernel(fn, *args):
    """`fn(*args)`, inside a replicated `shard_map` over the mesh of `on_mesh` if it has
    several devices."""
    if _mesh is None or _mesh.size == 1:
        return fn(*args)
    from jax.sharding import PartitionSpec as P

    return jax.shard_map(fn, mesh=_mesh, in_specs=P(), out_specs=P(), check_vma=False)(*args)


def target_platform() -> str:
    """The platform the traced program is compiled for, in order: `compile_for(...)`, the
    devices of the mesh in context (`jax.set_mesh` over a TPU topology's devices, or a
    `shard_map`'s mesh), then the default backend."""
    if _platform is not None:
        return _platform
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform if platform else jax.default_backend()


def accelerator() -> str | None:
    """"gpu" or "tpu" when the program is compiled for one (`target_platform`), else None."""
    platform = target_platform()
    return platform if platform in ("gpu", "tpu") else None


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
        raise ValueError(f"the {target_platform()} backend runs Pallas kernels only in "
                         "interpret mode: pass interpret=True (or interpret=None); to compile for a TPU "
                         "topology from this host, trace under pallas.compile_for('tpu') or jax.set_mesh "
                         "over the topology's devices")
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
