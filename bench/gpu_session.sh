#!/usr/bin/env bash
# GPU checks and benchmarks on an accelerator machine with no network: bash bench/gpu_session.sh STAGE...
# Expects wheels the machine lacks in .whl/ (trl, datasets, dill, multiprocess, liger-kernel) and the
# SmolLM2 tokenizer at $EDGERL_SHARED/data/smollm2-tokenizer (default .cache/shared). Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/edgerl-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 EDGERL_SHARED=${EDGERL_SHARED:-$PWD/.cache/shared} EDGERL_CACHE=/tmp/edgerl-cache
TOK=$EDGERL_SHARED/data/smollm2-tokenizer
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
run() {  # name, command...: log to $OUT/name.log, keep going on failure
    local name=$1; shift
    echo "=== $name: $*"; local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1; local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s"; tail -n 25 "$OUT/$name.log"
}
for stage in "$@"; do case $stage in
    info) run info bash -c "nvidia-smi; python3 -c 'import torch, triton, transformers, pyarrow; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, pyarrow.__version__, torch.cuda.get_arch_list())'; edgerl doctor --json | head -c 4000" ;;
    tests-train) run tests_train timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_train_cuda.py ;;
    tests) run tests timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_train_cuda.py tests/test_lora_cuda.py tests/test_rollout_cuda.py ;;
    kernels-bf16) run kernels_bf16 python3 bench/bench_logprobs.py --dtypes bf16 --out "$OUT/bench_logprobs_bf16.json" ;;
    kernels-fp32) run kernels_fp32 python3 bench/bench_logprobs.py --dtypes fp32 --out "$OUT/bench_logprobs_fp32.json" ;;
    rollout) run rollout timeout 200 python3 bench/bench_rollout.py --reps 2 --out "$OUT/bench_rollout.json" ;;
    trl) run vs_trl python3 bench/bench_vs_trl.py --tokenizer "$TOK" --out "$OUT/bench_vs_trl.json" ;;
    trl-1.7b) run vs_trl_17b timeout 150 python3 bench/bench_vs_trl.py --only 1.7b-p40 --steps 3 --timeout 140 --tokenizer "$TOK" --out "$OUT/bench_vs_trl_17b.json" ;;
    fit-full) run fit_full python3 bench/bench_fit.py --only full --timeout 150 --tokenizer "$TOK" --out "$OUT/bench_fit_full.json" ;;
    fit) run fit python3 bench/bench_fit.py --budget-s 260 --timeout 140 --tokenizer "$TOK" --out "$OUT/bench_fit.json" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
esac; done
