"""Deviceless ahead-of-time compilation for TPU topologies, from a host without a TPU.

With libtpu installed (`pip install -e .[tpu-aot]`, the version the installed jax
pins), `jax.experimental.topologies` describes the devices of a TPU slice on any
host. A mesh over them, an `Engine` of abstract models (`models.abstract`) and
`Engine.lower` (whose backend chooses kernels for the mesh's platform) give the whole generation program
as the TPU compiler builds it: the Pallas kernels trace as compiled Mosaic kernels
(not interpreted, although the host's backend is the CPU), and the
executable's `memory_analysis()` gives the bytes each chip needs.

    mesh = aot.topology_mesh("v5e:2x4")                  # (data 1, model 8)
    engine = Engine(models.abstract("llama-3.1-8b", jnp.bfloat16), draft=..., mesh=mesh, ...)
    report = aot.compile_report(engine, prompts)        # bytes per device, HBM, Mosaic kernels
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from specjax import sharding

GIB = 1 << 30
# HBM per chip (bytes), by the topology name's chip generation.
HBM_BYTES = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5litepod": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}
EXAMPLE_TOPOLOGIES = ("v5e:2x2", "v5e:2x4", "v4:2x2x1", "v5p:2x2x1", "v6e:2x4")
_MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'


class TopologyError(ValueError):
    """An unknown topology, or a mesh that does not match its chips."""


def libtpu_pip_command() -> str:
    """The pip command that installs the libtpu the installed jax pins (its `tpu` extra)."""
    pin = "libtpu"
    for req in importlib.metadata.requires("jax") or ():
        if req.startswith("libtpu") and "extra == \"tpu\"" in req:
            pin = req.split(";")[0].replace(" ", "")
    return f'python -m pip install -e ".[tpu-aot]"   (or: python -m pip install "{pin}")'


def check_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError("libtpu is not installed: compiling for a TPU topology on this host needs it; "
                           f"install it with: {libtpu_pip_command()}")


def chip_of(topology: str) -> str:
    """'v5e' of 'v5e:2x4'."""
    return topology.split(":", 1)[0].lower()


def hbm_bytes(topology: str) -> int:
    chip = chip_of(topology)
    if chip not in HBM_BYTES:
        raise TopologyError(f"unknown TPU generation {chip!r} in topology {topology!r} "
                            f"(known: {', '.join(sorted(HBM_BYTES))}; e.g. {', '.join(EXAMPLE_TOPOLOGIES)})")
    return HBM_BYTES[chip]


def topology_devices(topology: str) -> list:
    """The TPU devices of `topology` (e.g. "v5e:2x4"), described without a TPU."""
    if not re.fullmatch(r"[a-z0-9]+:\d+(x\d+)*", topology or ""):
        raise TopologyError(f"unknown topology {topology!r}: expected GENERATION:AxB[xC], "
                            f"e.g. {', '.join(EXAMPLE_TOPOLOGIES)}")
    hbm_bytes(topology)
    check_libtpu()
    # libtpu takes a host-wide lock file by default; describing a topology uses no chip, so
    # several compiling processes (tests in parallel, a binary under a test) may share it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:  # libtpu's message is long and generic; name the input
        if "lockfile" in str(e):
            raise RuntimeError(f"libtpu is locked by another process: {str(e).splitlines()[0][:300]}") from None
        raise TopologyError(f"unknown topology {topology!r} (libtpu: {str(e).splitlines()[0][:200]}); "
                            f"e.g. {', '.join(EXAMPLE_TOPOLOGIES)}") from None
    return list(desc.devices)


def topology_mesh(topology: str, mesh_shape: tuple[int, int] | None = None) -> Mesh:
    """A ("data", "model") mesh (Auto axes) over the chips of `topology`;
    `mesh_shape` (DATA, MODEL) defaults to all chips on "model"."""
    devices = topology_devices(topology)
    n = len(devices)
    shape = (1, n) if mesh_shape is None else tuple(int(x) for x in mesh_shape)
    if len(shape) != 2 or min(shape) < 1 or math.prod(shape) != n:
        raise TopologyError(f"mesh {','.join(map(str, shape))} does not match topology {topology!r}: "
                            f"it has {n} chips, the mesh needs DATA*MODEL = {math.prod(shape)}")
    return Mesh(np.asarray(devices).reshape(shape), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 2)


_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)")


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * (1 << (10 * " KMGT".index(unit or " "))))


def count_mosaic_kernels(text: str) -> int:
    """Mosaic (Pallas TPU) custom calls in a compiled program's HLO text (or a lowered
    program's StableHLO, where they are `stablehlo.custom_call @tpu_custom_call`)."""
    return text.count(_MOSAIC_CALL) + text.count("@tpu_custom_call")


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Per device (the compiled SPMD program is one partition's)."""

    chips: int
    hbm_bytes: int
    params_bytes: int  # target + draft parameters on the most loaded device (the plan)
    cache_bytes: int  # target + draft KV caches on the most loaded device (the plan)
    argument_bytes: int  # memory_analysis: inputs (parameters, prompts)
    output_bytes: int
    temp_bytes: int  # memory_analysis: temporaries (the KV caches live here: the program makes them)
    alias_bytes: int
    code_bytes: int
    mosaic_kernels: int
    compile_seconds: float
    # False when the TPU compiler refused the program for want of HBM (it checks at compile
    # time): the total is then the compiler's "total memory required" from its message
    # (temporaries = that total minus the planned parameters), and the
    # Mosaic kernels are counted in the lowered program
    compiled: bool = True
    note: str = ""
    bridge_bytes: int = 0  # a cross-vocabulary draft's translation tables (replicated; in params_bytes too)

    @property
    def bytes_per_device(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes + self.code_bytes

    @property
    def fits(self) -> bool:
        return self.bytes_per_device <= self.hbm_bytes


def hand_count(config, model_axis: int, data_axis: int, batch: int, max_len: int, itemsize: int,
               fsdp: bool = False) -> dict[str, int]:
    """Parameters and KV cache bytes per device, counted from the shapes by hand (not from a plan),
    for a model whose every dimension divides its mesh axes, heads placed as `sharding` places them
    on a model axis TP: H/TP query heads and lcm(G, TP)/TP KV heads per device (a KV head repeated
    where TP > G, docs/wide_tp.md); MLP and vocabulary split TP ways; norms replicated; with fsdp
    every weight also split DATA ways; the cache's rows split over "data" (k, v and int32 lengths).
    """
    D, H, G, Dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    F, V, L = config.intermediate_size, config.vocab_size, config.num_layers
    kv = math.lcm(G, model_axis) // model_axis
    layer = 2 * D * (H // model_axis) * Dh + 2 * D * kv * Dh + 3 * D * (F // model_axis) + 2 * D
    params = L * layer + D * (V // model_axis) * (1 if config.tie_embeddings else 2) + D
    if fsdp:
        params //= data_axis
    rows = batch // data_axis
    return {"params": params * itemsize, "cache": 2 * L * rows * max_len * kv * Dh * itemsize + 4 * rows}


def bridge_bytes(engine) -> int:
    """Bytes of a cross-vocabulary draft's tables (`vocab_bridge.Bridge`, on every device); 0 without one."""
    draft = engine.params.draft
    if not isinstance(draft, dict) or "bridge" not in draft:
        return 0
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(draft["bridge"]))


def compile_report(engine, prompts, topology: str) -> CompileReport:
    """Lowers and compiles `engine`'s whole generation program for its (topology) mesh."""
    import time

    mesh = engine.layout.mesh
    plan = sharding.memory_report(engine, len(prompts), engine.max_len)
    tables = bridge_bytes(engine)
    start = time.perf_counter()
    # the engine's backend chose the kernels for the mesh's platform, not the host's
    # (eager ops, e.g. a rule's fresh state, stay on the host)
    lowered = engine.lower(prompts)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        message = str(e)
        found = _OOM.search(message)
        if "RESOURCE_EXHAUSTED" not in message or found is None:
            raise
        # the compiler's "total memory required" (it exceeds the parameters alone, so it counts them)
        params = plan["target_params"] + plan["draft_params"]
        temp = max(_bytes(found.group(1), found.group(2)) - params, 0)
        return CompileReport(
            chips=mesh.size, hbm_bytes=hbm_bytes(topology),
            params_bytes=plan["target_params"] + plan["draft_params"],
            cache_bytes=plan["target_cache"] + plan.get("draft_cache", 0),
            argument_bytes=params, output_bytes=0, temp_bytes=temp,
            alias_bytes=0, code_bytes=0, mosaic_kernels=count_mosaic_kernels(lowered.as_text()),
            compile_seconds=time.perf_counter() - start, compiled=False,
            note="the TPU compiler refused it: " + found.group(0), bridge_bytes=tables)
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return CompileReport(
        chips=mesh.size, hbm_bytes=hbm_bytes(topology),
        params_bytes=plan["target_params"] + plan["draft_params"],
        cache_bytes=plan["target_cache"] + plan.get("draft_cache", 0),
        argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
        code_bytes=int(mem.generated_code_size_in_bytes),
        mosaic_kernels=count_mosaic_kernels(compiled.as_text()), compile_seconds=seconds, bridge_bytes=tables)
