#!/usr/bin/env bash
# The GPU checks, in one command with a time limit, from the project's root on a CUDA machine. Every
# step is a question of benchmarks/harness.py (or pytest, or the command itself), its record written
# to OUT. The steps come in the order of what they decide, so a cut-off run still decides the most:
#   1. decoding modes at the packaged model's shape (harness.py decoding): growing cache, static cache,
#      static + CUDA graphs (whole steps, the model's step alone), the graphs with transformers' sdpa,
#      with PyTorch's memory-efficient and math attention kernels and with transformers' unfused
#      modules (tokens compared, ms per step against the bandwidth floor); whether the graphs work
#      here decides the backend of every later run (BACKEND: the default cuda, whole steps recorded;
#      else cuda_model_step, the model's step alone; else cuda_eager)
#   2. the GPU tests, beside the models' building (tests.txt)
#   3. the side-by-side workload at the packaged shape, full fine-tuning, LoRA and full again (a process
#      after others on the machine) on BACKEND (harness.py floor): s/step, its phases, each pass against
#      its compute floor and generation against its bandwidth floor, memory, warm-up by phase; each run's
#      last step profiled (phases' host and device time, kernels), its Chrome traces in TRACES where given
#   4. decoding modes at the Qwen2.5-1.5B shape, LONG tokens (as step 1)
#   5. the Qwen2.5-1.5B shape at LONG tokens, micro-batches of 8, full fine-tuning and LoRA, as step 3
#   6. the decoding step compiled by torch.compile against the recorded graphs, at both shapes
#   7. TRL's GRPOTrainer on step 3's and step 5's workloads, where TRL is installed (harness.py vs_trl;
#      VS="ours trl" runs both sides alternated, the side by side of the issue: at least 3x faster per
#      step, peak GPU memory at most TRL's), then the packaged shape's full fine-tuning on the eager
#      backend, the baseline of step 3
#   8. the Qwen2.5-7B shape with LoRA and gradient checkpointing (experiment=n-grpo-7b-lora's model)
#   9. `ngrpo train experiment=ngrpo trainer=gpu` end to end (validation, checkpoint), then resume=last
#  10. a group's prompt run once or per row (the speed-up shared_prompts on and off, harness.py
#      speedup) at both shapes: whether the CUDA backend's rule pays
#  11. a new pass width's cost (harness.py widths): training passes at 16 widths never seen, then again,
#      with transformers' sdpa and with the backend's width buckets, with cuDNN's attention off, with the
#      driver's kernel cache off and with the CUDA libraries dropped from the OS page cache (a machine's
#      first process): what the first run's warm-up is
#  12. FSDP2 on one GPU (trainer=fsdp trainer.devices=1): rollouts on a copy of the gathered weights
#      against through the sharded policy (the speed-up decoding_copy on and off, harness.py speedup)
# Each step gets what is left of LIMIT seconds; records and logs go to OUT, the run of step 9 to RUN.
# All twelve do not fit one try: a session's 15 minutes hold two, e.g.
#   STEPS="1 2 3 5"       LIMIT=420 (the backend's choice, the GPU tests, the goals' table at both shapes)
#   STEPS="4 7 8 9 10 11 12" LIMIT=420 (FSDP2 last, cut first where time runs out)
# The GPU tests build the tiny model from the packaged model's tokenizer: on a machine without a
# network, carry a cache holding the built tiny model (NGRPO_CACHE=<carried dir>, with tiny/ in it);
# `bash benchmarks/gpu_bundle.sh DEST` (here, where there is a network) makes the WHEELS, SOURCE,
# PROBLEMS and that cache in one folder; its header says how to run this script with them.
#   TRACES    a directory for step 3's Chrome traces (gzipped; default: none written)
#   SOURCE    a directory with SmolLM2's tokenizer files and config.json (default: the packaged model's)
#   PROBLEMS  a .jsonl of problems, where reasoning-gym is not installed (harness.py problems writes it)
#   WHEELS    a directory of wheels the machine lacks, installed first into /tmp/site
#   STEPS     the steps to run (default all); without step 1 later runs use the default backend (cuda)
#   VS        step 7's sides (default trl: our rows are step 3's and 5's)
#   ACC=cpu TOK=8 LONG=8: a dry run of this script on the CPU (no graphs, no 7B), with MLflow and
#             reasoning-gym hidden as the GPU image lacks them (HIDE: the packages hidden);
#             DTYPE=float32 on a CPU without native bfloat16 products (AVX2 only)
set -u
ACC=${ACC:-gpu}; DTYPE=${DTYPE:-bfloat16}; TOK=${TOK:-40}; LONG=${LONG:-256}; LIMIT=${LIMIT:-540}; OUT=${OUT:-/tmp/gpu-checks}
PY=${PY:-python3}; MODELS=${MODELS:-/tmp/large-shapes}; RUN=${RUN:-$OUT/run}; STEPS=${STEPS:-1 2 3 4 5 6 7 8 9 10 11 12}
VS=${VS:-trl}
mkdir -p "$OUT"
. benchmarks/gpu_env.sh  # left, WHEELS, the environment, BW
want() { [[ " $STEPS " == *" $1 "* ]]; }
gpu() { [ "$ACC" = gpu ]; }
gpu && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c "import torch, transformers, peft, ngrpo_lightning.commands.cli; print(torch.__version__, transformers.__version__, peft.__version__)" || exit 1
if gpu && want 2; then  # beside the building
  timeout -s INT "$(left 120)" $PY -m pytest -q -p no:cacheprovider --tb=short tests/test_static_decoding.py \
    tests/test_host_syncs.py tests/test_phases.py tests/test_attention.py tests/test_fused.py tests/test_joined.py tests/test_lora_layer.py tests/test_step_graphs.py \
    tests/test_sampling.py tests/test_width_buckets.py tests/test_sharded_decoding.py -k on_a_gpu > "$OUT/tests.txt" 2>&1 &
  TESTS=$!
fi
H="$PY benchmarks/harness.py"
SMALL=$MODELS/smollm2-135m-$DTYPE; MID=$MODELS/qwen2.5-1.5b-$DTYPE
$H models --shapes smollm2-135m qwen2.5-1.5b --dtype $DTYPE --accelerator $ACC --models "$MODELS" ${SOURCE:+--source $SOURCE} || exit 1
CORES=$(nproc); THREADS=$(gpu && echo $((CORES < 8 ? CORES : 8)) || echo $CORES)  # a GPU run's CPU side: Python, tokenizing
# the workload's settings every run shares: our side's, or both sides' (vs_trl)
W="--dtype $DTYPE --accelerator $ACC --threads $THREADS --no-saves ${PROBLEMS:+--problems $PROBLEMS}"
F="$W $(gpu && echo --bandwidth-gbs $BW)"
DEV=$(gpu && echo cuda || echo cpu); GRAPH_MODES=$(gpu && echo graphs graphs-model graphs-sdpa graphs-unfused graphs-efficient graphs-math)
D="$H decoding --device $DEV --dtype $DTYPE ${BW:+--bandwidth-gbs $BW} ${PROBLEMS:+--problems $PROBLEMS}"
BACKEND=$(gpu && echo cuda || echo cpu)

if want 1; then
  echo "== 1. decoding modes, the packaged shape, $TOK tokens ($SECONDS s)"
  timeout -s INT "$(left 60)" $D --model $SMALL --new-tokens "$TOK" --repeats 2 --modes growing static $GRAPH_MODES \
    --out "$OUT/decoding_small.json"
  # whole-step graphs recorded: cuda; else the model's step alone: cuda_model_step; else none: cuda_eager
  gpu && BACKEND=$($PY -c "import json,sys; r={x['mode']: x for x in json.load(open(sys.argv[1]))['rows']}; \
ok=lambda m: m in r and 'error' not in r[m]; \
print('cuda' if ok('static + graphs') else 'cuda_model_step' if ok('static + graphs, model step only') else 'cuda_eager')" \
    "$OUT/decoding_small.json" 2>/dev/null || echo cuda_eager)
fi
echo "BACKEND=$BACKEND"
B=$(gpu && echo "--extra backend.name=$BACKEND")

if gpu && want 2; then
  echo "== 2. (waited for) the GPU tests ($SECONDS s)"; wait $TESTS; tail -40 "$OUT/tests.txt"
fi
if want 3; then
  echo "== 3. the packaged shape, $TOK tokens: full, LoRA and full on $BACKEND ($SECONDS s)"
  timeout -s INT "$(left 200)" $H floor $F --model $SMALL --modes full lora full --tokens "$TOK" --steps 4 $B \
    --profile ${TRACES:+--trace-dir $TRACES} --out "$OUT/small.json"
fi
if want 4; then
  echo "== 4. decoding modes, the Qwen2.5-1.5B shape, $LONG tokens ($SECONDS s)"
  timeout -s INT "$(left 120)" $D --model $MID --new-tokens "$LONG" --repeats 1 --modes growing static $GRAPH_MODES \
    --out "$OUT/decoding_1.5b.json"
fi
if want 5; then
  echo "== 5. Qwen2.5-1.5B shape, $LONG tokens, micro-batches of 8, full and LoRA on $BACKEND ($SECONDS s)"
  timeout -s INT "$(left 260)" $H floor $F --model $MID --modes full lora --tokens "$LONG" --steps 3 --micro-batch 8 \
    $B --profile --out "$OUT/1.5b.json"
fi
if gpu && want 6; then
  echo "== 6. decoding: recorded graphs against torch.compile's, both shapes ($SECONDS s)"
  timeout -s INT "$(left 120)" $D --model $SMALL --new-tokens "$TOK" --repeats 2 --modes static graphs compile \
    --out "$OUT/decoding_compile_small.json"
  timeout -s INT "$(left 150)" $D --model $MID --new-tokens "$LONG" --repeats 1 --modes static graphs compile \
    --out "$OUT/decoding_compile_1.5b.json"
fi
if gpu && want 7; then
  if $PY -c "import trl" 2>/dev/null; then
    echo "== 7. TRL's GRPOTrainer ($VS) on step 3's workload ($SECONDS s)"
    timeout -s INT "$(left 150)" $H vs_trl $F --sides $VS --runs 1 --model $SMALL --tokens "$TOK" --steps 4 $B \
      --out "$OUT/trl_small.json"
    echo "== 7a. TRL's GRPOTrainer ($VS) on step 5's workload ($SECONDS s)"
    timeout -s INT "$(left 270)" $H vs_trl $F --sides $VS --runs 1 --model $MID --tokens "$LONG" --micro-batch 8 \
      --steps 3 $B --out "$OUT/trl_1.5b.json"
  fi
  echo "== 7b. the packaged shape, $TOK tokens, full fine-tuning on the eager backend ($SECONDS s)"
  timeout -s INT "$(left 60)" $H floor $F --model $SMALL --modes full --tokens "$TOK" --steps 4 \
    --extra backend.name=cuda_eager --out "$OUT/small_eager.json"
fi
if gpu && want 8; then
  echo "== 8. Qwen2.5-7B shape, LoRA, gradient checkpointing, $LONG tokens, on $BACKEND ($SECONDS s)"
  $H models --shapes qwen2.5-7b --dtype $DTYPE --accelerator $ACC --models "$MODELS" ${SOURCE:+--source $SOURCE} &&
  timeout -s INT "$(left 200)" $H floor $F --model $MODELS/qwen2.5-7b-$DTYPE --modes lora --tokens "$LONG" --steps 2 \
    --micro-batch 8 --extra backend.name=$BACKEND model.gradient_checkpointing=true --out "$OUT/7b.json"
fi
if want 9; then
  echo "== 9. ngrpo train: N-GRPO, validation, checkpoint; then resume=last ($SECONDS s)"
  DATA=${PROBLEMS:+data=files data.train=$PROBLEMS data.val=$PROBLEMS data.val_limit=32}
  CLI="$PY -m ngrpo_lightning.commands.launch train experiment=ngrpo trainer=$ACC model.name_or_path=$SMALL
    model.dtype=$DTYPE $DATA data.prompts_per_step=4 trainer.val_check_interval=2 rollout.max_new_tokens=$TOK
    logger=none output_dir=$RUN trainer.enable_progress_bar=false $(gpu && echo backend.name=$BACKEND)"
  timeout -s INT "$(left 60)" $CLI trainer.max_steps=2 > "$RUN.cli.log" 2>&1; echo "rc=$?"; tail -3 "$RUN.cli.log"
  timeout -s INT "$(left 45)" $CLI trainer.max_steps=3 resume=last > "$RUN.resume.log" 2>&1; echo "rc=$?"; tail -3 "$RUN.resume.log"
fi
if want 10; then
  echo "== 10. a group's prompt once or per row: shared_prompts on and off, both shapes ($SECONDS s)"
  timeout -s INT "$(left 90)" $H speedup shared_prompts --workload side_by_side $W --model $SMALL --tokens "$TOK" \
    --steps 3 --pairs 1 $B --out "$OUT/sharing_small.json"
  timeout -s INT "$(left 150)" $H speedup shared_prompts --workload side_by_side $W --model $MID --tokens "$LONG" \
    --micro-batch 8 --steps 3 --pairs 1 $B --out "$OUT/sharing_1.5b.json"
fi
if want 11; then
  echo "== 11. a new pass width's cost: transformers' sdpa against the backend's width buckets ($SECONDS s)"
  S="$H widths --dtype $DTYPE"
  timeout -s INT "$(left 90)" $S --model $SMALL --widths 100:200 --calls "$(gpu && echo 16 || echo 3)" \
    --runs $(gpu && echo sdpa sdpa_gqa sdpa_gqa,no-cudnn sdpa,cold sdpa_gqa,cold sdpa_gqa,no-cudnn,cold \
    sdpa_gqa,cold-files || echo sdpa sdpa_gqa,no-cudnn,cold,cold-files) --out "$OUT/shapes_small.json"
  gpu && timeout -s INT "$(left 90)" $S --model $MID --widths 150:360 --calls 16 \
    --runs sdpa sdpa_gqa sdpa_gqa,no-cudnn --out "$OUT/shapes_1.5b.json"
fi
if want 12; then
  echo "== 12. FSDP2 on one device: rollouts on a copy of the gathered weights, on and off ($SECONDS s)"
  FSDP=$(gpu && echo "trainer=fsdp" || echo "trainer=fsdp_cpu trainer.parallel.data_parallel_size=auto")
  timeout -s INT "$(left 150)" $H speedup decoding_copy --workload side_by_side $W --model $SMALL --tokens "$TOK" \
    --steps 4 --pairs 1 --extra $FSDP trainer.devices=1 --out "$OUT/fsdp_copy.json"
fi
echo "== done ($SECONDS s)"
