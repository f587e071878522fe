#!/usr/bin/env bash
# GPU checks and benchmarks on an accelerator machine with no network:
#
#     bash bench/gpu_session.sh STAGE...     stages in order
#     bash bench/gpu_session.sh A+B          A on GPU 0 and B on GPU 1 at the same time (a two-GPU machine;
#                                            their speeds share the host's CPU cores and PCIe); SHARE_GPU=1:
#                                            both on GPU 0 (each run keeps its own memory cap; speeds share it)
#
# WORK: the work folder (default /tmp/edgerl-bench; an A+B pair's parts use WORK-gpu0, WORK-gpu1), so a later
# call can continue a resumable stage that ran as part of a pair.
#
# The whole command ends within SESSION_BUDGET_S seconds (default 565: under 9.5 minutes): a stage gets its
# own limit or what is left, whichever is less (less 25 s for the table at the end), and is skipped when
# under 30 s are left. The benchmarks write their JSON after every run, so a stage cut short keeps what it
# measured. Results: $OUT/*.json; every log: $OUT/session.log and $OUT/logs.tar.gz; a short table of
# everything is printed last (only the end of the output comes back).
#
# Needs: the wheels this machine lacks in .whl/ (trl 1.16.0, datasets, dill, multiprocess, xxhash,
# bitsandbytes 0.50.2; liger-kernel for the kernels stages), and the SmolLM2 tokenizer in
# $EDGERL_SHARED/data/smollm2-tokenizer (default .cache/shared; the recipes stages also read GSM8K from
# $EDGERL_SHARED/data/gsm8k/train.jsonl).
#
# Stages (limit in seconds):
#   quick 200       environment check (env_check.py), bench_vs_trl --smoke on this GPU (tiny shapes: TRL bf16,
#                   edgerl at a TRL-derived budget, TRL QLoRA and edgerl NF4 under the P40 cap), and
#                   bench_multi --smoke with NCCL when two GPUs are visible
#   measure 90      python -m edgerl.device.measure --json --pageable
#   trl-frontier 480  bench_vs_trl 362m-bf16 (TRL, edgerl on the whole GPU and at each --frontier budget)
#   trl-17b 300     bench_vs_trl 1.7b-bf16;   trl-p40 360: 362m-p40 and 1.7b-p40
#   trl-qwen7b 330, trl-llama8b 360, trl-llama8b-p40 360, trl-qwen14b 240: the QLoRA groups; trl-qlora 560: all three
#   trl-core 560, trl 560: several groups at once (more than one call holds; the budget stops them)
#   trl-longest 560 TRL's longest response: bench_vs_trl --only LONGEST_GROUP:trl (default qwen7b-p40, under its
#                   card's cap, edgerl's allocator settings; VS_ARGS=--trl-default-alloc adds torch's) for 2 steps at
#                   each of LONGEST_TOKENS (default 512 1024 2048 4096 8192) new tokens, doubling until a run fails
#   unsloth 560     Unsloth's GRPO beside TRL and edgerl (bench_vs_trl --unsloth; UNSLOTH_GROUPS, default 1.7b-bf16
#                   llama8b-t4, GROUP:trl for the peers alone) in an environment of its own (/tmp/site-unsloth ahead of
#                   the path: Unsloth 2026.10.9 wants TRL <= 1.15 and datasets < 5), from the wheels in .carry/unsloth*/
#                   (unsloth without its Studio web UI: benchlib.py drop-from-wheel WHEEL DIR studio/; unsloth_zoo,
#                   trl 1.15.0, datasets 4.8.5, xformers, torchao, cut_cross_entropy, msgspec; bitsandbytes from .whl;
#                   the machine has torchvision, sentencepiece, protobuf, accelerate and peft); a call on the machine
#                   still held keeps what an earlier one brought (/tmp/unsloth-wheels), for carries over 64 MiB
#   memory 400      bench_memory;   multi 480: bench_multi (two GPUs)
#   optim 120       bench_adamw_bf16: one optimizer step over 1.7B parameters, edgerl's bf16 AdamW and torch's
#                   (and over 362M parameters in host memory: streamed through the GPU, or on the host)
#   tests-optim 200 the bf16 AdamW and training CUDA tests
# STAGE_LIMIT_S: every stage's limit instead of its own (e.g. a QLoRA pair at 1024 tokens, longer than its stage's)
# VS_ONLY: the groups (GROUP[:edgerl|:trl]) of a one-group trl-* stage instead of its own, e.g. VS_ONLY=llama8b-t4:edgerl
#   (an --only in VS_ARGS would come before the stage's own, which wins)
# VS_ARGS: more bench_vs_trl options for its stages (e.g. --skip 1.7b-bf16/edgerl, or --edgerl-set
# run.profile_step=3: the step's profile table comes back in logs.tar.gz); OPTIM_PARAMS: optim's size (M); TESTS_K: -k of tests-optim
#   checks 560     the CUDA tests, measure and bench_rollout in one stage (for one GPU of an A+B pair)
#   qlora 400      qwen7b-p40 against TRL's QLoRA, and llama8b-t4 edgerl only (GROUP:edgerl)
#   tests-nf4 120   tests/test_nf4_kernel_cuda.py tests/test_decode_cuda_kernels_cuda.py (the NVRTC kernels)
#   attn-long 150   the decode kernels' CUDA tests (fp32 and fp16), then bench_decode_cuda_attention: the attention
#                   kernel whole, on the engine's default grid and in fixed slices of columns, at 256-8192 columns,
#                   beside torch's ops
#                   (ATTN_ARGS: more options, e.g. --dtype fp16)
#   fp16-decode 560 the CUDA C decode kernels in fp16 (what a T4 or V100 plan decodes through):
#                   their CUDA tests and the NF4 kernel's, the attention against torch's fp16 SDPA, the NF4 decode
#                   step at the Llama-3.1-8B widths, 8 rows (bitsandbytes, the fused kernel, and the cuda-c layers),
#                   and bench_rollout's 1.7B fp16 step through torch's ops (over spans of the cache and over the
#                   whole cache) and through cuda-c; the spans' CUDA test first
#   selftest-fp16 300  the fp16 plans' decode through the CUDA C kernels end to end: edgerl doctor --selftest forced to
#                   the t4 and v100 profiles (the default model, and Qwen2.5-7B widths over NF4 on the t4) at once,
#                   then bench_architectures in fp16 (Qwen3 through cuda-c against HF)
#   nf4-decode 200  bench_nf4_decode: the QLoRA fp32 decode step at the Qwen2.5-7B widths, NF4_LAYERS (28) layers
#   rollout-bf16 240  bench_rollout's bf16 configs only, the decode backends (ROLLOUT_VARIANTS; default: HF generate,
#                   torch's ops in the graph, the Triton attention kernel, and the Triton layers, which the plan
#                   picks), HF generate's own agreement as the bar
#   edgerl-17b 200  bench_vs_trl 1.7b-bf16, edgerl's side only at FRONTIER_17B GiB (default 18.46: TRL's memory
#                   for that shape, docs/benchmarks.md, Against TRL: 362M and 1.7B), no TRL run
#   recheck 420    edgerl's QLoRA runs, the 362M frontier at given budgets (FRONTIER) and four memory checks
#   decode-gemm 240 bench_decode_gemm.py --triton (the fused Triton projections against cuBLAS; GEMM_ARGS=--sweep
#                   adds a grid of tiles)
#   tests-layers 120 the CUDA tests of the Triton decode layers and their kernel
#   fp16-overflow 200 tests/test_fp16_overflow_cuda.py: a Gemma-3-shaped model with a layer past fp16's range under
#                   the t4 profile (the calibration on the GPU, fp32 around the layer, fp16 for the unscaled model,
#                   the stop that names the layer)
#   decode-long 300 bench_decode_long --profile: the decode step at cache columns 512, 2048 and 8192 for the P40 1.5B
#                   full, P40 7B NF4 and T4 8B NF4 plans (their rows, dtype and decode backend), against the bytes it
#                   reads as a share of the measured copy bound, and its fp32 FLOPs at the measured fp32 GEMM rate
#                   (DECODE_LONG_ARGS: more options, e.g. --configs)
#   fp32-mm 420     the fp32 few-row matmul (edgerl/kernels/fp32_mm.py): its CUDA tests and the cuda-c engine's, then
#                   bench_fp32_mm --sweep (each projection against cuBLAS at 16, 8 and 1 rows), then bench_decode_long
#                   --matmul plan,cublas for the P40 1.5B plan (FP32_MM_ARGS: more bench_decode_long options)
#   layer 150       bench_decode_layer: one decode layer's five Triton kernels, each one's GPU time (LAYER_ARGS=--sweep
#                   adds the attention kernel at other configurations)
#   long 560       bench_long --parallel --tf32: the long-response rows (1.5B full at 512-8K under a P40's memory, 7B NF4
#                   at 2K/4K under a P40's, 8B NF4 at 2K under a T4's), all at once, each under its own cap
#                   (LONG_ROWS: which; LONG_SERIAL=1: one after the other, each alone on the GPU, for speeds;
#                   LONG_ARGS=--resumable: a checkpoint per step, 90 s between the time limit's
#                   SIGTERM and the SIGKILL for the one being written, and the same command again on the machine
#                   still held continues each row up to LONG_STEPS in all: the 8K row is slower than one call)
#   recipes 560    bench_recipes --parallel --tf32: each recipe in examples/recipes, 3 steps under its card's memory,
#                  random weights at its model's real widths (a recipe for two GPUs only where two are visible)
#   archs 200      bench_architectures: Qwen3 and Gemma 3 on the static engine against HF in fp32, bf16 and fp16
#   recipes-archs 560  both at once (archs in the background: its check is of tokens, not of time)
#   recipes-long 560   recipes (RECIPES: which) and long (LONG_ROWS: which) at once, each run under its own cap
#   long-trl 560   the long rows (LONG_ROWS, LONG_STEPS, LONG_ARGS) beside bench_vs_trl jobs, each its own process
#                  and work folder sharing one set of model folders (built first: LONG_SHAPES): VS_JOBS holds
#                  each job's bench_vs_trl options, jobs separated by ';' (e.g. "--new-tokens 512 --only qwen7b-p40;
#                  --new-tokens 1024 --only qwen7b-p40:trl"): TRL at the long lengths
#   long-check 150 bench_long --offload-cost and --check (the code paths of those rows, in a minute)
#   learning 560   bench_learning: edgerl against TRL's GRPOTrainer on SmolLM2-135M-Instruct's real weights, TASK
#                  (arithmetic or gsm8k; one task a call), SEEDS (default 0 1 2), each run alone on the GPU, then
#                  the table (--summary) and the curves in $OUT/learning/; runs finished in an earlier call on the
#                  machine still held are kept (the budget cut the rest: call again); LEARNING_ARGS: more options (e.g.
#                  "--tools edgerl --variant hf --edgerl-set plan.rollout_engine=hf-generate"). The weights: GGUF, the path of
#                  SmolLM2-135M-Instruct.Q4_1.gguf carried to the machine (converted once into the cache); a call
#                  that finds the cache folder already there (the machine still held) needs no GGUF
#   tests-real 200 tests/test_real_weights_cuda.py: the static engine against HF on the same weights (GGUF as
#                  for learning), every decode backend in fp32, fp16 and bf16, EOS on
#   agents-recipes 560  bench_agents --only recipes: each tool recipe (examples/recipes, rollout.tools), 3 steps under its
#                  card's memory, a scripted tool-calling stand-in at the model's real widths; memory against the estimate
#   agents-trl 560 bench_agents --only trl: the multi-turn rollout at Qwen3-1.7B widths, edgerl's static engine and its
#                  HF generate path beside TRL's GRPOTrainer tools loop, in one call (AGENT_STEPS: steps, default 3)
#   tests-agents 120  tests/test_agents_cuda.py: the static engine's turns with CUDA graphs against a full recompute
#   info, tests-train, tests, kernels-bf16, kernels-fp32, rollout, trl-1.7b, fit-full, fit: as before
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
BUDGET=${SESSION_BUDGET_S:-565}
OUT=${OUT:-/tmp/edgerl-out}; mkdir -p "$OUT"
LOGS=/tmp/edgerl-logs; mkdir -p "$LOGS"
WORK=${WORK:-/tmp/edgerl-bench}
export OUT PYTHONUNBUFFERED=1 EDGERL_SHARED=${EDGERL_SHARED:-$PWD/.cache/shared} EDGERL_CACHE=/tmp/edgerl-cache
REAL_MODEL_AT=/tmp/edgerl-real-model.txt   # the folder GGUF was converted into (a later call on the machine still held reads it)
LONG_PARALLEL=$([ -n "${LONG_SERIAL:-}" ] || echo --parallel)   # the long stage's rows at once, unless LONG_SERIAL
export NCCL_NVLS_ENABLE=0 TOK=${EDGERL_SHARED:-$PWD/.cache/shared}/data/smollm2-tokenizer
if [ -z "${SKIP_INSTALL:-}" ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$LOGS/install_wheels.log" 2>&1 || { echo "wheel install failed:"; tail -20 "$LOGS/install_wheels.log"; }
    export PYTHONPATH=/tmp/site
fi
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: edgerl is installed already (a check of this script elsewhere)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
fi
UNSLOTH_WHEELS=/tmp/unsloth-wheels   # wheels for Unsloth's environment, gathered from every call (.carry/unsloth*/)
for d in .carry/unsloth*/; do [ -d "$d" ] && mkdir -p $UNSLOTH_WHEELS && cp "$d"*.whl $UNSLOTH_WHEELS/ 2>/dev/null; done
STATUS="$LOGS/stages.tsv"; : >"$STATUS"

stage_cmd() {  # stage, seconds, output suffix, work folder -> the stage's command line
    local t=$2 x=$3 w=$4 b=$(( $2 - 15 ))
    local vs="python3 bench/bench_vs_trl.py --tokenizer $TOK --work $w --budget-s $b ${VS_ARGS:-}"
    case $1 in
        info) echo "nvidia-smi; python3 -c 'import torch, triton, transformers, pyarrow; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, pyarrow.__version__, torch.cuda.get_arch_list())'; edgerl doctor --json | head -c 4000" ;;
        quick) echo "python3 bench/env_check.py --tokenizer $TOK;
              python3 bench/bench_vs_trl.py --smoke --only 362m-bf16 qwen7b-p40 --frontier trl --tokenizer $TOK --work $w-smoke --budget-s $(( b * 3 / 5 )) --out $OUT/quick$x.json;
              if [ \$(nvidia-smi -L | wc -l) -ge 2 ]; then python3 bench/bench_multi.py --smoke --tokenizer $TOK --work $w-smoke --budget-s $(( b * 2 / 5 - 10 )) --out $OUT/quick_multi$x.json; fi" ;;
        measure) echo "python3 -m edgerl.device.measure --json --pageable --budget 45 > $OUT/measure$x.json" ;;
        trl-frontier) echo "$vs --only 362m-bf16 ${FRONTIER:+--frontier $FRONTIER} --out $OUT/bench_vs_trl$x.json" ;;
        trl-17b) echo "$vs --only ${VS_ONLY:-1.7b-bf16} --out $OUT/bench_vs_trl$x.json" ;;
        edgerl-17b) echo "$vs --only 1.7b-bf16:edgerl --frontier-17b ${FRONTIER_17B:-18.46} --skip 1.7b-bf16/edgerl --out $OUT/bench_vs_trl$x.json" ;;
        trl-p40) echo "$vs --only ${VS_ONLY:-362m-p40 1.7b-p40} --out $OUT/bench_vs_trl$x.json" ;;
        trl-core) echo "$vs --only 362m-bf16 362m-p40 1.7b-bf16 1.7b-p40 --out $OUT/bench_vs_trl$x.json" ;;
        trl-qwen7b) echo "$vs --only ${VS_ONLY:-qwen7b-p40} --out $OUT/bench_vs_trl$x.json" ;;
        trl-llama8b) echo "$vs --only ${VS_ONLY:-llama8b-t4} --out $OUT/bench_vs_trl$x.json" ;;
        trl-llama8b-p40) echo "$vs --only ${VS_ONLY:-llama8b-p40} --out $OUT/bench_vs_trl$x.json" ;;
        trl-qwen14b) echo "$vs --only ${VS_ONLY:-qwen14b-p40} --out $OUT/bench_vs_trl$x.json" ;;
        trl-qlora) echo "$vs --only qwen7b-p40 llama8b-t4 qwen14b-p40 --out $OUT/bench_vs_trl$x.json" ;;
        qlora) echo "$vs --only qwen7b-p40 llama8b-t4:edgerl --out $OUT/bench_vs_trl$x.json" ;;
        recheck) echo "timeout -k 5 190 $vs --only qwen7b-p40:edgerl llama8b-t4:edgerl --out $OUT/bench_vs_trl$x.json;
              timeout -k 5 100 $vs --only 362m-bf16:edgerl --frontier ${FRONTIER:-4.72,2.36} --out $OUT/bench_vs_trl$x.json;
              timeout -k 5 120 python3 bench/bench_memory.py --tokenizer $TOK --work $w --budget-s 110 --only 1.7b-bf16-lora 1.7b-bf16-nf4 362m-bf16-grpo 1.7b-bf16-adamw-bf16 --out $OUT/bench_memory$x.json" ;;
        trl) echo "$vs --out $OUT/bench_vs_trl$x.json" ;;
        trl-1.7b) echo "$vs --only 1.7b-p40 --steps 3 --timeout 140 --out $OUT/bench_vs_trl_17b$x.json" ;;
        unsloth) echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-unsloth $UNSLOTH_WHEELS/*.whl > $LOGS/install_unsloth$x.log 2>&1 || { tail -20 $LOGS/install_unsloth$x.log; exit 1; };
                  PYTHONPATH=/tmp/site-unsloth:\${PYTHONPATH:-} HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 python3 -c 'import unsloth, trl, datasets; print(\"unsloth\", unsloth.__version__, \"trl\", trl.__version__, \"datasets\", datasets.__version__)' 2>&1 | tail -25;
                  EDGERL_UNSLOTH_PATH=/tmp/site-unsloth $vs --unsloth --only ${UNSLOTH_GROUPS:-1.7b-bf16 llama8b-t4} --out $OUT/bench_vs_trl_unsloth$x.json" ;;
        trl-longest) echo "for n in ${LONGEST_TOKENS:-512 1024 2048 4096 8192}; do left=\$(( $t - 20 - SECONDS )); [ \$left -lt 60 ] && { echo \"TRL at \$n: not run, \$left s left\"; break; };
                  timeout -k 5 \$left python3 bench/bench_vs_trl.py --tokenizer $TOK --work $w --budget-s \$left --only ${LONGEST_GROUP:-qwen7b-p40}:trl --new-tokens \$n --steps 2 ${VS_ARGS:-} --out $OUT/trl_longest_\${n}$x.json > $LOGS/trl_longest_\${n}$x.log 2>&1;
                  st=\$(python3 bench/benchlib.py statuses $OUT/trl_longest_\${n}$x.json); echo \"TRL at \$n new tokens: \$st\";
                  case \$st in ok*) ;; *) break ;; esac; done" ;;
        optim) echo "python3 bench/bench_adamw_bf16.py --device cuda --params ${OPTIM_PARAMS:-1700} --host-params 362 --reps 5 --out $OUT/bench_adamw_bf16$x.json" ;;
        memory) echo "python3 bench/bench_memory.py --tokenizer $TOK --work $w --budget-s $b --out $OUT/bench_memory$x.json" ;;
        multi) echo "python3 bench/bench_multi.py --tokenizer $TOK --work $w --budget-s $b --out $OUT/bench_multi$x.json" ;;
        tests-nf4) echo "python3 -m pytest -q -p no:cacheprovider tests/test_nf4_kernel_cuda.py tests/test_decode_cuda_kernels_cuda.py 2>&1 | tee $OUT/tests_nf4$x.log | tail -30" ;;
        decode-long) echo "python3 bench/bench_decode_long.py --profile ${DECODE_LONG_ARGS:-} --out $OUT/bench_decode_long$x.json" ;;
        attn-long) echo "python3 -m pytest -q -p no:cacheprovider tests/test_decode_cuda_kernels_cuda.py 2>&1 | tee $OUT/tests_attn$x.log | tail -20;
              python3 bench/bench_decode_cuda_attention.py ${ATTN_ARGS:-} --out $OUT/bench_decode_cuda_attention$x.json" ;;
        tests-train) echo "python3 -m pytest -q -p no:cacheprovider tests/test_train_cuda.py tests/test_packing_cuda.py 2>&1 | tee $OUT/tests_train$x.log | tail -30" ;;
        tests-optim) echo "python3 -m pytest -q -p no:cacheprovider tests/test_adamw_bf16_cuda.py tests/test_train_cuda.py ${TESTS_K:+-k \"$TESTS_K\"} 2>&1 | tee $OUT/tests_optim$x.log | tail -30" ;;
        tests) echo "python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/test_train_cuda.py tests/test_packing_cuda.py tests/test_lora_cuda.py tests/test_rollout_cuda.py tests/test_quant_cuda.py tests/test_adamw_bf16_cuda.py tests/test_models_cuda.py tests/test_decode_cuda_kernels_cuda.py tests/test_nf4_kernel_cuda.py 2>&1 | tee $OUT/tests$x.log | tail -40" ;;
        checks) echo "timeout -k 5 260 python3 -m pytest -q -p no:cacheprovider -x --timeout 240 tests/test_train_cuda.py tests/test_packing_cuda.py tests/test_lora_cuda.py tests/test_rollout_cuda.py tests/test_quant_cuda.py tests/test_adamw_bf16_cuda.py tests/test_models_cuda.py 2>&1 | tee $OUT/tests$x.log | tail -30;
              timeout -k 5 60 python3 -m edgerl.device.measure --json --pageable --budget 40 > $OUT/measure$x.json;
              python3 bench/bench_rollout.py --reps 2 --budget-s $(( b - 330 )) --out $OUT/bench_rollout$x.json" ;;
        kernels-bf16) echo "python3 bench/bench_logprobs.py --dtypes bf16 --out $OUT/bench_logprobs_bf16$x.json" ;;
        kernels-fp32) echo "python3 bench/bench_logprobs.py --dtypes fp32 --out $OUT/bench_logprobs_fp32$x.json" ;;
        rollout) echo "python3 bench/bench_rollout.py --reps 2 --out $OUT/bench_rollout$x.json" ;;
        decode-gemm) echo "python3 bench/bench_decode_gemm.py --triton ${GEMM_ARGS:-} --out $OUT/bench_decode_gemm$x.json" ;;
        layer) echo "python3 bench/bench_decode_layer.py ${LAYER_ARGS:-} --budget-s $(( b - 20 )) --out $OUT/bench_decode_layer$x.json" ;;
        tests-layers) echo "python3 -m pytest -q -p no:cacheprovider tests/test_rollout_cuda.py -k 'triton or decode_linear'" ;;
        fp16-overflow) echo "python3 -m pytest -q -p no:cacheprovider --timeout 180 tests/test_fp16_overflow_cuda.py 2>&1 | tee $OUT/tests_fp16_overflow$x.log | tail -30" ;;
        fp16-decode) echo "timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_cuda_kernels_cuda.py tests/test_nf4_kernel_cuda.py 'tests/test_rollout_cuda.py::test_spans_in_graphs_give_the_whole_caches_rollout' 2>&1 | tee $OUT/tests_fp16$x.log | tail -20;
              timeout -k 5 100 python3 bench/bench_decode_cuda_attention.py --dtype fp16 --cols 256,2048,4096,8192 --splits 256,512 --out $OUT/bench_decode_cuda_attention_fp16$x.json;
              timeout -k 5 150 python3 bench/bench_nf4_decode.py --shape llama8b --compute fp16 --rows 8 --layers 8 --row-sweep 8 --out $OUT/bench_nf4_decode_fp16$x.json;
              python3 bench/bench_rollout.py --reps 2 --configs 1.7b:fp16 --variants graph_torch,graph_torch_whole,graph_cuda_c --new-tokens 1024 --budget-s $(( b > 480 ? b - 420 : 60 )) --out $OUT/bench_rollout_fp16$x.json" ;;
        selftest-fp16) echo "for a in 't4' 'v100' 't4 --model qwen2.5-7b --set lora.enabled=true'; do n=\$(echo \$a | tr -c 'a-z0-9' _);
                  timeout -k 5 $(( t - 100 )) edgerl doctor --selftest --profile \$a --json --out $OUT/selftest_\${n}$x.json > $LOGS/selftest_\${n}$x.log 2>&1 & done; wait;
              tail -n 3 $LOGS/selftest_*$x.log; timeout -k 5 80 python3 bench/bench_architectures.py --dtypes fp16 --out $OUT/bench_architectures_fp16$x.json | tail -5" ;;
        nf4-decode) echo "python3 bench/bench_nf4_decode.py --layers ${NF4_LAYERS:-28} --row-sweep 16 ${NF4_ARGS:-} --out $OUT/bench_nf4_decode$x.json" ;;
        rollout-bf16) echo "python3 bench/bench_rollout.py --reps 2 --configs 360m:bf16,1.7b:bf16 --variants ${ROLLOUT_VARIANTS:-hf_generate,graph_torch,graph_triton_attention,graph_triton_layers} --budget-s $(( b - 20 )) --out $OUT/bench_rollout_bf16$x.json" ;;
        fit-full) echo "python3 bench/bench_fit.py --only full --timeout 150 --tokenizer $TOK --out $OUT/bench_fit_full$x.json" ;;
        long) echo "python3 bench/bench_long.py $LONG_PARALLEL --tf32 --steps ${LONG_STEPS:-3} ${LONG_ROWS:+--only $LONG_ROWS} ${LONG_ARGS:-} --timeout $(( b - 60 )) --budget-s $b --tokenizer $TOK --work $w --out $OUT/bench_long$x.json" ;;
        recipes) echo "python3 bench/bench_recipes.py --parallel --tf32 --steps ${RECIPE_STEPS:-3} ${RECIPES:+--only $RECIPES} --timeout $(( b - 60 )) --budget-s $b --tokenizer $TOK --work $w --out $OUT/bench_recipes$x.json" ;;
        recipes-long) echo "python3 bench/bench_recipes.py --parallel --tf32 --steps ${RECIPE_STEPS:-3} ${RECIPES:+--only $RECIPES} --timeout $(( b - 60 )) --budget-s $b --tokenizer $TOK --work $w-recipes --out $OUT/bench_recipes$x.json > $LOGS/recipes$x.log 2>&1 &
              python3 bench/bench_long.py --parallel --tf32 --steps ${LONG_STEPS:-3} ${LONG_ROWS:+--only $LONG_ROWS} --timeout $(( b - 60 )) --budget-s $b --tokenizer $TOK --work $w --out $OUT/bench_long$x.json; wait" ;;
        long-trl) echo "for s in ${LONG_SHAPES:-1.5b qwen7b llama8b}; do python3 bench/benchlib.py ensure $w $TOK \$s > $LOGS/build-\${s}$x.log 2>&1 & done; wait;
              left=\$(( $t - 25 - SECONDS )); echo models ready, \$left s left;
              i=0; IFS=';' read -ra jobs <<< \"\${VS_JOBS:-}\"; for j in \"\${jobs[@]}\"; do i=\$((i + 1)); mkdir -p $w-vs\$i; ln -sfn $w/models $w-vs\$i/models;
                  timeout -k 5 \$(( left + 10 )) python3 bench/bench_vs_trl.py --tokenizer $TOK --work $w-vs\$i --budget-s \$left --shared-gpu \$j --out $OUT/bench_vs_trl_long\${i}$x.json > $LOGS/vs\${i}$x.log 2>&1 & done;
              ${LONG_ROWS:+python3 bench/bench_long.py --parallel --tf32 --steps ${LONG_STEPS:-3} --only $LONG_ROWS ${LONG_ARGS:-} --timeout \$(( left - 30 )) --budget-s \$left --tokenizer $TOK --work $w --out $OUT/bench_long$x.json;} wait" ;;
        learning) echo "${GGUF:+python3 -m edgerl.models.embedded $GGUF > $REAL_MODEL_AT &&} python3 bench/bench_learning.py --task ${TASK:-arithmetic} --seeds ${SEEDS:-0 1 2} --device cuda --model \$(tail -1 $REAL_MODEL_AT) ${LEARNING_ARGS:-} --budget-s $(( b - 15 )) --work $w-learning --out $w-learning/results;
              mkdir -p $OUT/learning; cp $w-learning/results/*.json $OUT/learning/; python3 bench/bench_learning.py --summary $OUT/learning --plot $OUT/learning" ;;
        tests-real) echo "${GGUF:+python3 -m edgerl.models.embedded $GGUF > $REAL_MODEL_AT &&} EDGERL_REAL_MODEL=\$(tail -1 $REAL_MODEL_AT) python3 -m pytest -q -p no:cacheprovider -rs tests/test_real_weights_cuda.py 2>&1 | tee $OUT/tests_real$x.log | tail -30" ;;
        archs) echo "python3 bench/bench_architectures.py --out $OUT/bench_architectures$x.json" ;;
        recipes-archs) echo "timeout -k 5 200 python3 bench/bench_architectures.py --out $OUT/bench_architectures$x.json > $LOGS/archs$x.log 2>&1 &
              python3 bench/bench_recipes.py --parallel --tf32 --steps ${RECIPE_STEPS:-3} --timeout $(( b - 60 )) --budget-s $b --tokenizer $TOK --work $w --out $OUT/bench_recipes$x.json; wait" ;;
        long-check) echo "python3 bench/bench_long.py --offload-cost --out $OUT/bench_long$x.json; python3 bench/bench_long.py --check --tf32 --tokenizer $TOK --work $w --out $OUT/bench_long_check$x.json" ;;
        fit) echo "python3 bench/bench_fit.py --budget-s 260 --timeout 140 --tokenizer $TOK --out $OUT/bench_fit$x.json" ;;
        agents-recipes) echo "python3 bench/bench_agents.py --only recipes --steps ${AGENT_STEPS:-3} --timeout $(( b - 60 )) --budget-s $b --tokenizer $TOK --work $w --out $OUT/bench_agents$x.json" ;;
        agents-trl) echo "python3 bench/bench_agents.py --only trl --steps ${AGENT_STEPS:-3} --timeout $(( b / 3 )) --budget-s $b --tokenizer $TOK --work $w --out $OUT/bench_agents_trl$x.json" ;;
        fp32-mm) echo "python3 -m pytest -q -p no:cacheprovider tests/test_fp32_mm_cuda.py tests/test_decode_cuda_kernels_cuda.py 2>&1 | tee $OUT/tests_fp32_mm$x.log | tail -15; python3 bench/bench_fp32_mm.py --sweep --out $OUT/bench_fp32_mm$x.json; python3 bench/bench_decode_long.py --configs p40-1.5b-full --matmul plan,cublas ${FP32_MM_ARGS:-} --out $OUT/bench_decode_long_fp32mm$x.json" ;;
        tests-agents) echo "python3 -m pytest -q -p no:cacheprovider tests/test_agents_cuda.py 2>&1 | tee $OUT/tests_agents$x.log | tail -20" ;;
        *) return 1 ;;
    esac
}

limit_of() {
    case $1 in
        info) echo 60 ;; quick) echo 200 ;; measure) echo 90 ;; trl-frontier) echo 480 ;; trl-17b) echo 300 ;;
        trl-p40) echo 360 ;; trl-qwen7b) echo 330 ;; trl-llama8b) echo 360 ;; trl-llama8b-p40) echo 360 ;; trl-qwen14b) echo 240 ;;
        trl-1.7b) echo 150 ;; trl-longest) echo 560 ;; decode-long) echo 300 ;; fp32-mm) echo 420 ;; memory) echo 400 ;; optim) echo 120 ;;
        multi) echo 480 ;; tests-train) echo 120 ;; tests-optim) echo 200 ;; tests) echo 300 ;; rollout) echo 200 ;; fit-full) echo 200 ;;
        checks) echo 560 ;; qlora) echo 400 ;; rollout-bf16) echo 240 ;; decode-gemm) echo 240 ;; tests-layers) echo 120 ;; fp16-overflow) echo 200 ;; layer) echo 150 ;; edgerl-17b) echo 200 ;; nf4-decode) echo 200 ;; fp16-decode) echo 560 ;; selftest-fp16) echo 300 ;; tests-nf4) echo 120 ;; attn-long) echo 150 ;; recheck) echo 420 ;;
        fit) echo 300 ;; long) echo 560 ;; recipes) echo 560 ;; archs) echo 200 ;; recipes-archs) echo 560 ;; recipes-long) echo 560 ;; long-trl) echo 560 ;; long-check) echo 150 ;; learning) echo 560 ;; tests-real) echo 200 ;; tests-agents) echo 120 ;; *) echo 560 ;;
    esac
}

run_stage() {  # stage, output suffix, work folder: run it within its limit and the session's
    local s=$1 x=$2 w=$3 lim left t cmd start rc
    lim=${STAGE_LIMIT_S:-$(limit_of "$s")}; left=$(( BUDGET - (SECONDS - START) - 25 )); t=$(( lim < left ? lim : left ))
    if ! cmd=$(stage_cmd "$s" "$t" "$x" "$w"); then echo "unknown stage $s"; printf '%s\t%s\t%s\n' "$s$x" "unknown" 0 >>"$STATUS"; return; fi
    if [ "$t" -lt 30 ]; then
        echo "=== $s$x: skipped, $left s left"; printf '%s\t%s\t%s\n' "$s$x" "skipped" 0 >>"$STATUS"; return
    fi
    echo "=== $s$x (limit $t s${CUDA_VISIBLE_DEVICES:+, GPU $CUDA_VISIBLE_DEVICES}): $cmd"
    start=$SECONDS
    timeout -k 10 "$t" bash -c "$cmd" >"$LOGS/$s$x.log" 2>&1; rc=$?
    [ $rc -eq 124 ] && rc="timeout"
    echo "=== $s$x: rc=$rc in $((SECONDS - start)) s"; tail -n 6 "$LOGS/$s$x.log"
    printf '%s\t%s\t%s\n' "$s$x" "$rc" "$((SECONDS - start))" >>"$STATUS"
}

for item in "$@"; do
    if [[ $item == *+* ]]; then
        IFS=+ read -ra parts <<<"$item"; i=0
        for s in "${parts[@]}"; do
            CUDA_VISIBLE_DEVICES=$(( ${SHARE_GPU:-0} ? 0 : i )) run_stage "$s" "_gpu$i" "$WORK-gpu$i" &
            i=$((i + 1))
        done
        wait
    else
        run_stage "$item" "" "$WORK"
    fi
done

for f in "$LOGS"/*.log; do echo "##### $(basename "$f")"; cat "$f"; done >"$OUT/session.log" 2>/dev/null
find "$LOGS" "$WORK"* -type f \( -name '*.log' -o -name 'plan.json' -o -name 'metrics.jsonl' \
    -o -name '*.spec.json' -o -path '*/profile/*.txt' \) -size -20M 2>/dev/null | tar -czf "$OUT/logs.tar.gz" -T - 2>/dev/null
echo; echo "=== stages (rc, seconds; session $((SECONDS - START)) s of $BUDGET s)"; column -t "$STATUS" 2>/dev/null || cat "$STATUS"
echo; python3 bench/summary.py "$OUT"
