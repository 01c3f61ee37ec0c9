#!/usr/bin/env bash
# The side by side with TRL's GRPOTrainer on one CUDA GPU (issue: at least 3x faster per step, peak
# GPU memory at most TRL's), from the project's root, after benchmarks/gpu_checks.sh has built the
# models (or with MODELS pointing at a folder large_shapes.py wrote). Both sides load the same
# randomly initialised bfloat16 models; EOS suppressed; 4 prompts x 8 completions; one run per side.
#   1. the packaged model's shape, 40 tokens
#   2. the Qwen2.5-1.5B shape, 256 tokens, micro-batches of 8 on both sides
# Each step gets what is left of LIMIT seconds; results (JSON, logs) go to OUT.
#   WHEELS    a directory of wheels the machine lacks, installed into /tmp/site: gpu_checks.sh's, and TRL
#             (the version of pyproject.toml's bench extra) with what it needs there (datasets, and
#             datasets' dill, multiprocess, xxhash, fsspec where missing)
#   SOURCE    as in gpu_checks.sh: the tokenizer files and SmolLM2's config.json
#   PROBLEMS  a .jsonl of problems for both sides, where reasoning-gym is not installed (gpu_checks.sh's)
#   OURS      our side as vs_trl.py names it (default ours: the default backend; ours-eager: no graphs)
#   ACC=cpu TOK=4 LONG=4: a dry run of this script on the CPU (MLflow and reasoning-gym hidden, HIDE)
set -u
ACC=${ACC:-gpu}; TOK=${TOK:-40}; LONG=${LONG:-256}; LIMIT=${LIMIT:-420}; OUT=${OUT:-/tmp/gpu-vs-trl}
PY=${PY:-python3}; MODELS=${MODELS:-/tmp/large-shapes}; mkdir -p "$OUT"
OURS=${OURS:-ours}
. benchmarks/gpu_env.sh  # left, WHEELS, the environment, BW
$PY -c "import trl, torch; print('trl', trl.__version__, 'torch', torch.__version__)" || exit 1
# the models (kept where gpu_checks.sh built them)
$PY benchmarks/large_shapes.py --build-only --shapes smollm2-135m qwen2.5-1.5b --accelerator $ACC --models "$MODELS" \
  ${SOURCE:+--source $SOURCE} || exit 1
V="$PY benchmarks/vs_trl.py --accelerator $ACC --dtype bfloat16 --sides $OURS trl --runs 1 --no-saves --bandwidth-gbs $BW
  ${PROBLEMS:+--problems $PROBLEMS}"
echo "== 1. the packaged model's shape, $TOK tokens ($SECONDS s)"
timeout -s INT "$(left 150)" $V --model "$MODELS/smollm2-135m-bfloat16" --tokens "$TOK" --steps 4 --out "$OUT/small.json"
echo "== 2. Qwen2.5-1.5B shape, $LONG tokens, micro-batches of 8 ($SECONDS s)"
timeout -s INT "$(left 270)" $V --model "$MODELS/qwen2.5-1.5b-bfloat16" --tokens "$LONG" --micro-batch 8 --steps 3 \
  --out "$OUT/1.5b.json"
echo "== done ($SECONDS s)"
