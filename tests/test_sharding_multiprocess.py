"""Two processes on localhost (jax.distributed, CPU collectives), four fake CPU devices each,
one (2, 4) mesh: the same tokens as one process. Bounded: each process has a hard timeout."""

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


def test_two_processes_give_the_single_process_tokens():
    dist = load_distributed()
    # the single-process reference: one device, the same model, prompts and settings
    expected, _, _ = dist.run(model="tiny", draft="pld", method="fly", k=2, max_new_tokens=6, prompts=None,
                              batch=0, seed=0, mesh_shape=None)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), f"--coordinator_address=127.0.0.1:{port}",
                               "--num_processes=2", f"--process_id={i}", "--local_devices=4", *FLAGS],
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
    for info in infos:
        assert info["processes"] == 2 and info["devices"] == 8 and info["local_devices"] == 4
        assert info["tokens"] == expected
        # parameters split over the model axis: far less than the whole tiny model per device
        assert 0 < info["bytes_per_device"]["target_params"] < 0.5 * sum(
            x.nbytes for x in jax.tree.leaves(dist.tiny_models(0)[0].params))
