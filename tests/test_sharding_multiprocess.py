"""Two processes on localhost (jax.distributed, CPU collectives), four fake CPU devices each,
one (2, 4) mesh: the same tokens as one process. Bounded: each process has a hard timeout.

Per-shard loading: on a (1, 8) mesh the model axis spans both processes, so each process holds
half of every sharded weight and must read only that half of the checkpoint (counted by the
loader, `shards.BYTES_READ`). With 2 KV heads on that axis each KV head is repeated for 4 devices
(wide tensor parallelism): each process reads only the file's KV head its devices hold."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest

from _distributed import load_distributed  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "distributed.py"
TIMEOUT_S = 240
FLAGS = ["--model=tiny", "--draft=pld", "--method=fly", "--k=2", "--max_new_tokens=6", "--mesh=2,4", "--json"]

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the binary asks for 4 CPU devices itself (--local_devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_two_processes(flags):
    """The JSON lines of the two processes of one run."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), f"--coordinator_address=127.0.0.1:{port}",
                               "--num_processes=2", f"--process_id={i}", "--local_devices=4", *flags],
                              cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 0, f"process exited with {p.returncode}:\n{err[-3000:]}"
            outputs.append(out)
    finally:
        for p in procs:  # never leave a process behind (e.g. one waiting for its peer)
            if p.poll() is None:
                p.kill()
                p.wait()
    infos = [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out in outputs]
    assert sorted(info["process"] for info in infos) == [0, 1]
    return infos


def test_two_processes_give_the_single_process_tokens():
    """The adaptive loop (the default) on a mesh over two processes: both weigh the widths against
    one cost table (process 0's), so they run one program; a loose rule's tokens depend on the
    widths chosen, so the single-device reference is given that table."""
    from specjax.costs import CostTable

    dist = load_distributed()
    infos = run_two_processes(FLAGS)
    assert infos[0]["costs"] is not None and infos[0]["costs"] == infos[1]["costs"]
    assert infos[0]["widths"] == infos[1]["widths"]
    # the single-process reference: one device, the same model, prompts, settings and costs
    expected, _, _, extras = dist.run(model="tiny", draft="pld", method="fly", k=2, max_new_tokens=6, prompts=None,
                                      batch=0, seed=0, mesh_shape=None, costs=CostTable(**infos[0]["costs"]))
    assert extras["widths"] == infos[0]["widths"]
    for info in infos:
        assert info["processes"] == 2 and info["devices"] == 8 and info["local_devices"] == 4
        assert info["tokens"] == expected
        # parameters split over the model axis: far less than the whole tiny model per device
        assert 0 < info["bytes_per_device"]["target_params"] < 0.5 * sum(
            x.nbytes for x in jax.tree.leaves(dist.tiny_models(0)[0].params))


def _layer_bytes(path, fmt):
    """(bytes of all per-layer tensors in the file, bytes of the per-layer norm scales)."""
    if fmt == "gguf":
        import gguf

        tensors = [(t.name, int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors if t.name.startswith("blk.")]
        is_norm = lambda name: name.endswith("_norm.weight")  # noqa: E731
    else:
        from safetensors import safe_open

        with safe_open(path / "model.safetensors", framework="numpy") as f:
            tensors = [(k, f.get_slice(k)[:].nbytes) for k in f.keys() if k.startswith("model.layers.")]
        is_norm = lambda name: name.endswith("layernorm.weight")  # noqa: E731
    return sum(n for _, n in tensors), sum(n for name, n in tensors if is_norm(name))


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_each_process_reads_half_of_the_layers(fmt, tmp_path):
    """A checkpoint written here (bf16 safetensors; Q8_0 GGUF with llama.cpp's RoPE row order),
    loaded per shard by two processes on a (1, 8) mesh: the tokens of one process that loads
    it whole, and each process reads half of the layer bytes. The tolerance is the per-layer
    norm scales, which are replicated (every process reads them whole): here under 0.4% of the
    layer bytes; every sharded weight splits on whole rows / whole Q8_0 blocks, so the count is
    exact: half of the sharded bytes plus all of the norms."""
    import _checkpoints

    path = (_checkpoints.write_hf(tmp_path / "hf", dtype="bfloat16") if fmt == "safetensors"
            else _checkpoints.write_gguf(tmp_path / "tiny.gguf"))
    dist = load_distributed()
    # fixed K: the point is what each process reads (the adaptive loop: the test above)
    expected, _, _, _ = dist.run(model=str(path), draft="pld", method="fly", k=2, max_new_tokens=6, prompts=None,
                                 batch=0, seed=0, mesh_shape=None, cache=False, adaptive=False)
    infos = run_two_processes([f"--model={path}", "--draft=pld", "--method=fly", "--k=2", "--max_new_tokens=6",
                               "--mesh=1,8", "--nocache", "--noadaptive", "--json"])
    layers, norms = _layer_bytes(path, fmt)
    assert norms / layers < 0.004
    for info in infos:
        assert info["tokens"] == expected
        read = info["checkpoint_bytes_read"]["layers"]
        assert read == (layers - norms) // 2 + norms
        assert 0.5 <= read / layers <= 0.5 + norms / layers


@pytest.mark.heavy
def test_wide_tp_each_process_reads_only_its_kv_head(tmp_path):
    """8 query heads / 2 KV heads (bf16 Qwen2-style safetensors, k/v biases) on a (1, 8) mesh over
    two processes: "auto" repeats each KV head 4 times, and the per-shard load reads them so. The
    tokens are those of one device, and each process reads exactly half of every sharded layer
    tensor (process 0 the file's KV head 0, process 1 head 1) plus the replicated norms."""
    import _checkpoints

    shape = {**_checkpoints.SHAPE, "num_heads": 8, "num_kv_heads": 2}
    path = _checkpoints.write_hf(tmp_path / "wide", shape=shape, qwen2=True, dtype="bfloat16")
    dist = load_distributed()
    # fixed K: the point is what each process reads (the adaptive loop: the test above)
    expected, _, _, _ = dist.run(model=str(path), draft="pld", method="fly", k=2, max_new_tokens=6, prompts=None,
                                 batch=0, seed=0, mesh_shape=None, cache=False, adaptive=False)
    infos = run_two_processes([f"--model={path}", "--draft=pld", "--method=fly", "--k=2", "--max_new_tokens=6",
                               "--mesh=1,8", "--nocache", "--noadaptive", "--json"])
    layers, norms = _layer_bytes(path, "safetensors")
    # per device, float32: H/TP = 1 query head and 1 KV head (aot.hand_count) and their biases (q, k, v)
    from specjax import aot
    from specjax.models import load

    c = load(path, cache=False).config
    hand = aot.hand_count(c, 8, 1, 8, 64, 4)["params"] + c.num_layers * 3 * c.head_dim * 4
    for info in infos:
        assert info["tokens"] == expected
        assert info["checkpoint_bytes_read"]["layers"] == (layers - norms) // 2 + norms
        assert info["bytes_per_device"]["target_params"] == hand
