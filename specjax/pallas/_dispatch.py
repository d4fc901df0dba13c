"""Choosing between a compiled kernel, an interpreted kernel and the jnp reference.

Every public function in `specjax.pallas` takes `impl=None | "kernel" | "reference"`,
`interpret=None | bool` and `backend=None | specjax.backend.Backend`. With `impl=None` the
choice comes from, in order: `backend.pallas`, the environment variable `SPECJAX_PALLAS`
("auto", "kernel", "reference"), then "auto": the compiled kernel on GPU and TPU, the jnp
reference on CPU (the interpreter is slow). `interpret=None` interprets the kernel exactly
when the target platform is neither GPU nor TPU, so `SPECJAX_PALLAS=kernel` forces the
kernel everywhere, in interpret mode on CPU.

The platform is the one the program is compiled for (`target_platform`): `backend.platform`,
else the devices of a mesh in context (`jax.set_mesh`, as a deviceless AOT compilation for a
TPU topology does), else the default backend; so a CPU host can compile the Mosaic kernels
for a TPU. No module state takes part: the choice follows from the arguments (and the
environment variable) when a function is traced.
"""

from __future__ import annotations

import os

import jax

from specjax import backend as _backend

ENV_VAR = "SPECJAX_PALLAS"
_IMPLS = _backend.PALLAS_IMPLS
_VARIANTS = _backend.PALLAS_VARIANTS


def run_kernel(fn, *args, backend=None):
    """`fn(*args)`, inside a replicated `shard_map` over `backend.mesh` if it has several devices."""
    mesh = _backend.of(backend).mesh
    if mesh is None or mesh.size == 1:
        return fn(*args)
    from jax.sharding import PartitionSpec as P

    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(*args)


def target_platform(backend=None) -> str:
    """The platform the traced program is compiled for, in order: `backend.platform`, the
    devices of the mesh in context (`jax.set_mesh` over a TPU topology's devices, or a
    `shard_map`'s mesh), then the default backend."""
    platform = _backend.of(backend).platform
    if platform is not None:
        return platform
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform if platform else jax.default_backend()


def accelerator(backend=None) -> str | None:
    """"gpu" or "tpu" when the program is compiled for one (`target_platform`), else None."""
    platform = target_platform(backend)
    return platform if platform in ("gpu", "tpu") else None


def resolve_impl(impl: str | None, backend=None) -> str:
    """Returns "kernel" or "reference"."""
    if impl is None:
        impl = _backend.of(backend).pallas or os.environ.get(ENV_VAR, "") or "auto"
        where = f"backend.pallas / ${ENV_VAR}"
    else:
        where = "impl"
    if impl not in _IMPLS:
        raise ValueError(f"{where} must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "kernel" if accelerator(backend) else "reference"
    return impl


def resolve_interpret(interpret: bool | None, backend=None) -> bool:
    if interpret is None:
        interpret = _backend.of(backend).interpret
    if interpret is None:
        return accelerator(backend) is None
    return bool(interpret)


def resolve_variant(variant: str | None, backend=None) -> str:
    """Kernel flavour: "triton" (one program per row and vocabulary split, masked
    loads; GPU) or "mosaic" (BlockSpec pipeline over a (rows, vocabulary) grid with
    the vocabulary as the reduction axis; TPU). Both run in interpret mode."""
    if variant is None:
        variant = _backend.of(backend).variant
    if variant is None:
        return "triton" if accelerator(backend) == "gpu" else "mosaic"
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS} or None, got {variant!r}")
    return variant


def resolve_backend(backend) -> "_backend.Backend":
    """`backend` with its Pallas choices resolved for its platform: `pallas` "kernel" or "reference"
    (from `backend.pallas`, $SPECJAX_PALLAS, else "auto"), `interpret`, `variant` and `platform`
    set. The Engine builds its backend through this once, so the traced program reads plain fields
    (the rules call the plain jnp statistics or the kernel without asking this module again)."""
    backend = _backend.of(backend)
    platform = target_platform(backend)
    return backend.replace(pallas=resolve_impl(None, backend), interpret=resolve_interpret(None, backend),
                           variant=resolve_variant(None, backend),
                           platform=platform if platform in _backend.PLATFORMS else backend.platform)


def check_compiled_variant(variant: str, interpret: bool, backend=None) -> None:
    """A compiled (non-interpreted) kernel needs the backend its variant lowers to."""
    if interpret:
        return
    platform = accelerator(backend)
    if platform is None:
        raise ValueError(f"the {target_platform(backend)} backend runs Pallas kernels only in "
                         "interpret mode: pass interpret=True (or interpret=None); to compile for a TPU "
                         "topology from this host, pass backend=Backend(platform='tpu') or trace under "
                         "jax.set_mesh over the topology's devices")
    want = "triton" if platform == "gpu" else "mosaic"
    if variant != want:
        raise ValueError(f"variant {variant!r} does not compile on {platform}; use {want!r} "
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
