#!/usr/bin/env bash
# The GPU checks, in one command with a time limit, from the project's root on a CUDA machine:
#   1. the side-by-side workload on the packaged model's shape, full fine-tuning and LoRA
#   2. the Qwen2.5-7B shape with LoRA and gradient checkpointing (experiment=n-grpo-7b-lora's model)
#   3. the Qwen2.5-1.5B shape at 256 tokens, full fine-tuning and LoRA
#   4. `ngrpo train experiment=ngrpo trainer=gpu` end to end (validation, checkpoint), then resume=last
#   5. decoding modes (growing cache, static cache, static + CUDA graphs) at both shapes, against the floor
#   1b, 3b: steps 1 and 3 (full fine-tuning) on backend.name=cuda_graphs, the CUDA backend decoding from
#      kept CUDA graphs (what the default CUDA backend becomes once these figures say it is faster)
#   5c: the decoding step compiled by torch.compile (reduce-overhead) against the recorded graphs,
#      last, with whatever time is left (compilation is the slow part: its time is in first_run_s)
# Each step gets what is left of LIMIT seconds; results (JSON, logs) go to OUT.
#   SOURCE    a directory with SmolLM2's tokenizer files and config.json (default: the packaged model's)
#   PROBLEMS  a .jsonl of problems, where reasoning-gym is not installed
#             (write it elsewhere first: python benchmarks/large_shapes.py --export-problems problems.jsonl)
#   WHEELS    a directory of wheels the machine lacks, installed first into /tmp/site (a machine without network)
#   ACC=cpu TOK=8 LONG=8: a dry run of this script on the CPU
set -u
ACC=${ACC:-gpu}; TOK=${TOK:-40}; LONG=${LONG:-256}; LIMIT=${LIMIT:-540}; OUT=${OUT:-/tmp/gpu-checks}
PY=${PY:-python3}; MODELS=${MODELS:-/tmp/large-shapes}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh  # left, WHEELS, the environment
[ "$ACC" = gpu ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c "import torch, transformers, peft, ngrpo_lightning.commands.cli; print(torch.__version__, transformers.__version__, peft.__version__)" || exit 1
G="$PY benchmarks/large_shapes.py --accelerator $ACC --models $MODELS ${SOURCE:+--source $SOURCE} ${PROBLEMS:+--problems $PROBLEMS}"
echo "== 1. the packaged model's shape, $TOK tokens, full and LoRA ($SECONDS s)"
timeout -s INT "$(left 150)" $G --shapes smollm2-135m --modes full lora --tokens "$TOK" --steps 4 --out "$OUT/small.json"
if [ "$ACC" = gpu ]; then
  echo "== 1b. the same, full fine-tuning, decoding from CUDA graphs ($SECONDS s)"
  timeout -s INT "$(left 90)" $G --shapes smollm2-135m --modes full --tokens "$TOK" --steps 4 \
    --extra backend.name=cuda_graphs --out "$OUT/small_graphs.json"
fi
if [ "$ACC" = gpu ]; then
  echo "== 2. Qwen2.5-7B shape, LoRA, gradient checkpointing, $LONG tokens ($SECONDS s)"
  timeout -s INT "$(left 240)" $G --shapes qwen2.5-7b --modes lora --tokens "$LONG" --steps 3 --micro-batch 8 \
    --extra model.gradient_checkpointing=true --out "$OUT/7b.json"
fi
echo "== 3. Qwen2.5-1.5B shape, $LONG tokens, micro-batches of 8, full and LoRA ($SECONDS s)"
timeout -s INT "$(left 170)" $G --shapes qwen2.5-1.5b --modes full lora --tokens "$LONG" --steps 3 --micro-batch 8 \
  --out "$OUT/1.5b.json"
if [ "$ACC" = gpu ]; then
  echo "== 3b. the same, full fine-tuning, decoding from CUDA graphs ($SECONDS s)"
  timeout -s INT "$(left 110)" $G --shapes qwen2.5-1.5b --modes full --tokens "$LONG" --steps 3 --micro-batch 8 \
    --extra backend.name=cuda_graphs --out "$OUT/1.5b_graphs.json"
fi
echo "== 4. ngrpo train: N-GRPO, validation, checkpoint; then resume=last ($SECONDS s)"
DATA=${PROBLEMS:+data=files data.train=$PROBLEMS data.val=$PROBLEMS data.val_limit=32}
CLI="$PY -m ngrpo_lightning.commands.launch train experiment=ngrpo trainer=$ACC model.name_or_path=$MODELS/smollm2-135m-bfloat16
  model.dtype=bfloat16 $DATA data.prompts_per_step=4 trainer.val_check_interval=2 rollout.max_new_tokens=$TOK
  logger=none output_dir=$OUT/run trainer.enable_progress_bar=false"
timeout -s INT "$(left 60)" $CLI trainer.max_steps=2 > "$OUT/cli.log" 2>&1; echo "rc=$?"; tail -3 "$OUT/cli.log"
timeout -s INT "$(left 45)" $CLI trainer.max_steps=3 resume=last > "$OUT/resume.log" 2>&1; echo "rc=$?"; tail -3 "$OUT/resume.log"
echo "== 5. decoding modes: growing, static, static + CUDA graphs; tokens equal, ms/step against the floor ($SECONDS s)"
DEV=$([ "$ACC" = gpu ] && echo cuda || echo cpu); BW=${BANDWIDTH:-3350}
timeout -s INT "$(left 60)" $PY benchmarks/decoding_modes.py --model $MODELS/smollm2-135m-bfloat16 --device $DEV \
  --dtype bfloat16 --new-tokens "$TOK" --repeats 2 --bandwidth-gbs $BW --out "$OUT/decoding_small.json"
timeout -s INT "$(left 90)" $PY benchmarks/decoding_modes.py --model $MODELS/qwen2.5-1.5b-bfloat16 --device $DEV \
  --dtype bfloat16 --new-tokens "$LONG" --repeats 1 --bandwidth-gbs $BW --out "$OUT/decoding_1.5b.json"
[ "$ACC" = gpu ] && timeout -s INT "$(left 60)" $PY -m pytest -q tests/test_static_decoding.py tests/test_host_syncs.py -k cuda_graph
if [ "$ACC" = gpu ]; then
  echo "== 5c. decoding: recorded graphs against torch.compile's ($SECONDS s)"
  timeout -s INT "$(left 90)" $PY benchmarks/decoding_modes.py --model $MODELS/smollm2-135m-bfloat16 --device cuda \
    --dtype bfloat16 --new-tokens "$TOK" --repeats 2 --bandwidth-gbs $BW --modes static graphs compile \
    --out "$OUT/decoding_compile_small.json"
  timeout -s INT "$(left 120)" $PY benchmarks/decoding_modes.py --model $MODELS/qwen2.5-1.5b-bfloat16 --device cuda \
    --dtype bfloat16 --new-tokens "$LONG" --repeats 1 --bandwidth-gbs $BW --modes static graphs compile \
    --out "$OUT/decoding_compile_1.5b.json"
fi
echo "== done ($SECONDS s)"
