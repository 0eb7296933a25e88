#!/usr/bin/env bash
# What a GPU lease checks, as one script: tests/gpu, the kernel benchmark, and what scoring costs on the device.
#
# Usage, from the repository root on the CUDA machine:
#   bash benchmarks/gpu_checks.sh OUT_DIR [WHEELS_DIR]
#
# That machine has torch and Triton but no network. If its Python lacks transformers 5.2, the wheels come from
# WHEELS_DIR, downloaded beforehand where PyPI is reachable and carried along (.gpu-wheels is git-ignored; the device
# tool's ``carry``). What this script imports beyond torch and Triton is transformers and what it imports:
#   pip download --no-deps -d .gpu-wheels transformers==5.2.0 'tokenizers==0.22.*' 'huggingface-hub==1.*' safetensors
# (install.log names anything else the machine lacks).
# curkv_train runs from a copy laid out as pip would install it (kernels/ as curkv_train.kernels, ...), so nothing is
# built. The embedded GGUF model does not travel (over a device call's 64 MiB): the scoring cost runs the shipped
# SmolLM2 and Llama-2-70B configs (data/model_configs) with random weights (timing does not depend on them). Each step has its own time
# limit; the whole run takes about 12 minutes of a session's 15, more than one device call's 10, so run it as two
# calls: ONLY="NAME ..." runs just the steps named (the first call every step but decode_smollm2, the second that
# one). Logs land in OUT_DIR, one per step.
set -u
out=${1:?usage: bash benchmarks/gpu_checks.sh OUT_DIR [WHEELS_DIR]}
wheels=${2:-}
repo=$PWD
mkdir -p "$out"
out=$(cd "$out" && pwd)
export TRITON_INTERPRET=0

if ! python -c "import transformers, sys; sys.exit(transformers.__version__ != '5.2.0')" 2>/dev/null; then
  [ -n "$wheels" ] || { echo "transformers 5.2.0 is missing and no WHEELS_DIR was given" >&2; exit 2; }
  python -m pip install --no-index --find-links "$wheels" --no-deps "$wheels"/*.whl > "$out/install.log" 2>&1 ||
    { echo "installing the carried wheels failed: $out/install.log" >&2; exit 2; }
fi

site=$(mktemp -d)
cp -r "$repo/curkv_train" "$site/curkv_train"
ln -s "$repo/kernels" "$site/curkv_train/kernels"
for pair in recipes:_recipes checkpoints:_checkpoints data:_data; do
  ln -s "$repo/${pair%%:*}" "$site/curkv_train/${pair##*:}"
done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
             'transformers', transformers.__version__)"; } > "$out/env.log" 2>&1

step() {  # step NAME SECONDS COMMAND...: run from $site (the repository's own curkv_train folder would shadow the copy)
  local name=$1 limit=$2
  shift 2
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0  # ONLY="a b": just those steps (a second call)
  local start=$SECONDS
  (cd "$site" && timeout "$limit" "$@") > "$out/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s"
}

step tests_gpu 300 python -m pytest "$repo/tests/gpu" --rootdir "$repo" -c "$repo/pyproject.toml" -p no:cacheprovider
step bench_scored_attention 150 python "$repo/benchmarks/bench_scored_attention.py" --n 4096 16384
scoring=(python "$repo/benchmarks/bench_scoring_cost.py" --device cuda --dtype bfloat16 --random-weights --repeats 3
         --scorer init:query_aware)
step scoring_smollm2 120 "${scoring[@]}" --base HuggingFaceTB/SmolLM2-135M-Instruct --contexts 1024,4096
step scoring_smollm2_compiled 180 "${scoring[@]}" --base HuggingFaceTB/SmolLM2-135M-Instruct --contexts 1024,4096 --compile
step scoring_llama70b 120 "${scoring[@]}" --base meta-llama/Llama-2-70b-hf --layers 4 --contexts 1024,4096
step scoring_llama70b_torch_features 120 "${scoring[@]}" --base meta-llama/Llama-2-70b-hf --layers 4 \
  --contexts 1024,4096 --feature-backend torch
# a decode step's overhead, with the re-compressions' scoring eager, compiled, and replayed as CUDA graphs
step decode_smollm2 240 python "$repo/benchmarks/bench_decode.py" --device cuda --dtype bfloat16 --random-weights \
  --base HuggingFaceTB/SmolLM2-135M-Instruct --scorer init:query_aware --contexts 4096 --keeps 0.5 --new-tokens 256 \
  --settings default,compiled,graphs --rounds 2
tail -n 3 "$out"/*.log
