r"""Runs one generation on a device mesh, in one process or across several (jax.distributed).

One host, 8 fake CPU devices as a (2, 4) mesh:

    python experiments/distributed.py --local_devices=8 --mesh=2,4 --model=tiny --draft=pld --method=fly

Two processes on localhost, four fake CPU devices each, one 8-device mesh (CPU collectives: gloo):

    python experiments/distributed.py --coordinator_address=localhost:12355 --num_processes=2 \
        --process_id=0 --local_devices=4 --mesh=2,4 --model=tiny &
    python experiments/distributed.py --coordinator_address=localhost:12355 --num_processes=2 \
        --process_id=1 --local_devices=4 --mesh=2,4 --model=tiny

A GPU node or TPU slice: --local_devices=0 (use the accelerators), --mesh=DATA,MODEL over all
devices of all processes. On a TPU pod or under SLURM, jax.distributed finds the coordinator
itself: pass --num_processes=-1 (auto) and no --coordinator_address.

A checkpoint (--model / --draft: preset, .gguf or HF directory) is loaded per shard on the
mesh (`models.load(..., mesh=)`): each process reads only the parts its devices hold, e.g. half
of each layer weight per process on a --mesh=1,8 over two processes (the model axis spans both).

Every process prints the same tokens (the outputs are replicated), the bytes of parameters and
KV caches on its most loaded device, and the checkpoint bytes it read; with --json, one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags

from experiments import _paths as P

_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (jax.distributed); unset: one process.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in the run (-1: detect, e.g. TPU pod/SLURM).")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index in [0, num_processes).")
_LOCAL_DEVICES = flags.DEFINE_integer("local_devices", 4,
                                      "Fake CPU devices in this process; 0: the platform's own devices (GPU/TPU).")
_MESH = flags.DEFINE_string("mesh", "", "DATA,MODEL sizes of the ('data', 'model') mesh; default 1,ALL.")
_MODEL = flags.DEFINE_string("model", "tiny", "'tiny' (random weights), a preset name, a .gguf or an HF dir.")
_DRAFT = flags.DEFINE_string("draft", "pld", "none, pld, self:N, tiny (random draft for --model=tiny), "
                             "or a model (preset, .gguf, HF dir) sharing the target's tokenizer.")
_DRAFT_SHARDING = flags.DEFINE_enum("draft_sharding", "shard", ["shard", "replicate"],
                                    "Shard the draft model like the target, or replicate it.")
_ATTENTION = flags.DEFINE_enum("attention", "auto", ["auto", "replicate", "pad", "repeat_kv"],
                               "auto: shard heads when they divide the model axis, else repeat KV heads where "
                               "that places them, else replicate attention; repeat_kv: each chip holds the KV "
                               "head its query heads read; pad: append zero heads until they divide.")
_METHOD = flags.DEFINE_string("method", "greedy", "Verification method.")
_K = flags.DEFINE_integer("k", 4, "Draft tokens per round.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 16, "New tokens per prompt.")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "A prompt (text for real models); repeat for a batch.")
_BATCH = flags.DEFINE_integer("batch", 0, "Repeat the prompts cyclically up to this batch size (0: as given).")
_SEED = flags.DEFINE_integer("seed", 0, "Generation seed (and the tiny models' weights).")
_JSON = flags.DEFINE_boolean("json", False, "Print one JSON line: tokens, per-device bytes, layout.")
_CACHE = flags.DEFINE_boolean("cache", True, "Use (and, in one process, write) the converted-parameter cache.")
_ADAPTIVE = flags.DEFINE_boolean("adaptive", True, "Choose the verify width each round (as the Engine); "
                                 "--noadaptive: always K.")

TINY_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7, 7, 7, 7],
                [40, 41, 42, 43], [1, 2, 3, 1, 2, 3, 1], [99], [60, 61, 60, 61, 62]]


def random_params(config, seed: int, std: float = 0.05):
    """Random parameters from NumPy (norm scales 1): the same in every process, and no
    compiled Linen init (seconds per model on a busy CPU)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.models import llama

    tokens = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(llama.Transformer(config).init, jax.random.PRNGKey(0), tokens, tokens)["params"]
    rng = np.random.default_rng(seed)

    def one(path, x):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return np.ones(x.shape, np.float32)
        return (rng.standard_normal(x.shape) * std).astype(np.float32)

    return jax.tree_util.tree_map_with_path(one, shapes)


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
            head_dim=8, rope_theta=500.0)
TINY_DRAFT = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=500.0)


def tiny_models(seed: int):
    """The random target (8 heads / 4 kv heads) and draft (4 / 2) of `--model=tiny`."""
    from specjax.models import Config, Model

    target, draft = Config(**TINY), Config(**TINY_DRAFT)
    return (Model(target, random_params(target, seed), name=f"tiny-{seed}"),
            Model(draft, random_params(draft, seed + 1), name=f"tiny-draft-{seed + 1}"))


def run(*, model: str, draft: str, method: str, k: int, max_new_tokens: int, prompts, batch: int, seed: int,
        mesh_shape=None, draft_sharding="shard", attention="auto", cache=True, adaptive=True, costs=None):
    """(tokens, memory report, layout description, extras) of one generation; mesh_shape None: one
    device. extras: the widths the loop chose and the cost table it weighed them against (as a
    dict; None when the loop does not adapt), so that a run can be repeated with the same table.

    A checkpoint is loaded per shard on the mesh (each process reads its devices' parts)."""
    import jax

    import specjax
    from specjax import models, sharding

    mesh = None
    if mesh_shape is not None:
        mesh = sharding.MeshConfig(jax.make_mesh(mesh_shape, ("data", "model")), attention=attention,
                                   draft=draft_sharding)

    def load(source, role):
        return models.load(source, cache=cache, mesh=None if mesh is None or attention == "pad" else mesh,
                           role=role)

    if model == "tiny":
        target, tiny_draft = tiny_models(seed)
        ids = [list(p) for p in (prompts or TINY_PROMPTS)]
    else:
        target, tiny_draft = load(model, "target"), None
        if target.tokenizer is not None:
            ids = [target.tokenizer.chat_prompt_ids(p) for p in (prompts or ["Write a haiku about JAX."])]
        elif prompts:
            raise app.UsageError(f"{model} has no tokenizer: text prompts cannot be encoded")
        else:  # a checkpoint without a tokenizer (tests): token ids
            ids = [[t % target.config.vocab_size for t in p] for p in TINY_PROMPTS]
    if batch:
        ids = [ids[i % len(ids)] for i in range(batch)]
    if draft == "none":
        d = None
    elif draft == "tiny":
        if tiny_draft is None:
            raise app.UsageError("--draft=tiny goes with --model=tiny")
        d = tiny_draft
    elif draft == "pld" or draft.startswith("self:"):
        d = draft
    else:
        d = load(draft, "draft")
    engine = specjax.Engine(target, draft=d, method=method, k=k, max_new_tokens=max_new_tokens, seed=seed,
                            eos_ids=(), mesh=mesh, adaptive=adaptive, costs=costs)
    out = engine.generate(ids)
    table = engine.cost_table(len(ids))
    extras = {"widths": out.stats.get("widths"),
              "costs": None if table is None else {"verify_s": list(table.verify_s),
                                                   "draft_step_s": table.draft_step_s}}
    return out.tokens, sharding.memory_report(engine, len(ids)), sharding.describe(engine.layout), extras


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import jax

    if _LOCAL_DEVICES.value:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", _LOCAL_DEVICES.value)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if _COORDINATOR.value or _NUM_PROCESSES.value != 1:
        jax.distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=None if _NUM_PROCESSES.value < 0 else _NUM_PROCESSES.value,
            process_id=None if _NUM_PROCESSES.value < 0 else _PROCESS_ID.value,
            initialization_timeout=60)
    n = jax.device_count()
    mesh_shape = tuple(int(x) for x in _MESH.value.split(",")) if _MESH.value else (1, n)
    if len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != n:
        raise app.UsageError(f"--mesh={_MESH.value!r} must be DATA,MODEL with DATA*MODEL = {n} devices")
    start = time.perf_counter()
    tokens, memory, layout, extras = run(model=_MODEL.value, draft=_DRAFT.value, method=_METHOD.value, k=_K.value,
                                 max_new_tokens=_MAX_NEW.value, prompts=_PROMPT.value, batch=_BATCH.value,
                                 seed=_SEED.value, mesh_shape=mesh_shape, draft_sharding=_DRAFT_SHARDING.value,
                                 attention=_ATTENTION.value, cache=_CACHE.value, adaptive=_ADAPTIVE.value)
    seconds = time.perf_counter() - start
    from specjax.models import shards

    info = {"process": jax.process_index(), "processes": jax.process_count(), "devices": n,
            "local_devices": jax.local_device_count(), "mesh": list(mesh_shape), "tokens": tokens,
            "bytes_per_device": memory, "checkpoint_bytes_read": dict(shards.BYTES_READ),
            **extras, "seconds": round(seconds, 2)}
    if _JSON.value:
        print(json.dumps(info), flush=True)
    else:
        print(f"process {info['process']}/{info['processes']}: {n} devices, mesh {mesh_shape}, {seconds:.1f}s\n"
              f"{layout}", file=sys.stderr)
        for name, value in memory.items():
            print(f"  {name:>14}: {value / 2**20:9.2f} MiB per device", file=sys.stderr)
        for what, value in sorted(shards.BYTES_READ.items()):
            print(f"  checkpoint bytes read ({what}): {value}", file=sys.stderr)
        for row in tokens:
            print(row)
    if jax.process_count() > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    P.run(main)
