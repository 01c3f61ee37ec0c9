#!/usr/bin/env bash
# The GPU checks, in one command with a time limit, from the project's root on a CUDA machine.
# The steps come in the order of what they decide, so a cut-off run still decides the most:
#   1. decoding modes at the packaged model's shape: growing cache, static cache, static + CUDA
#      graphs, and the graphs with transformers' sdpa (its KV heads copied per query head, where the
#      backend's attention stacks the query heads) and with transformers' unfused norms and
#      attention (tokens compared, ms per step against the bandwidth floor); whether the graphs
#      work here decides the backend of every later run (BACKEND: the default cuda, whole steps
#      recorded; else cuda_model_step, the model's step alone; else cuda_eager)
#   2. the GPU tests, beside the models' building: graph and compiled decoding against eager for
#      every built-in explorer, the training forward rebuilding the replayed rollouts, no host
#      waits per token, the sampler's blockwise scan, FSDP2's rollouts on a copy from graphs
#      against through the policy (tests.txt)
#   3. the side-by-side workload at the packaged shape, full fine-tuning and LoRA on BACKEND: s/step,
#      its phases, generation against its bandwidth floor (gen_x_floor), memory, warm-up; each run's
#      last step profiled (the phases' host and device time, kernels: large_shapes.py --profile),
#      its Chrome traces in TRACES where given; full fine-tuning runs again last, its warm-up that of
#      a process after others on the machine (the first one's had been 3-7x LoRA's, run second)
#      (200 s: reading a profile back takes seconds)
#   4. decoding modes at the Qwen2.5-1.5B shape, 256 tokens (as step 1)
#   5. the Qwen2.5-1.5B shape at 256 tokens, micro-batches of 8, full fine-tuning and LoRA on BACKEND,
#      profiled as in step 3 (no traces; 260 s: on an H200 full fine-tuning's run took 112 s)
#   6. the decoding step compiled by torch.compile (reduce-overhead) against the recorded graphs at
#      the packaged shape (compilation is the slow part: its time is in first_run_s), then at the
#      Qwen2.5-1.5B shape
#   7. TRL's GRPOTrainer on step 3's and step 5's workloads, where TRL is installed (deliverable 5's
#      baseline), and the packaged shape's full fine-tuning on the eager backend, the baseline of step 3
#   8. the Qwen2.5-7B shape with LoRA and gradient checkpointing (experiment=n-grpo-7b-lora's model)
#   9. `ngrpo train experiment=ngrpo trainer=gpu` end to end (validation, checkpoint), then resume=last
#  10. a group's prompt run once or per row, the log-prob passes timed both ways at both shapes, beside
#      what the CUDA backend decides (benchmarks/prompt_sharing.py: its "right" column)
#  11. a new pass width's cost (benchmarks/attention_shapes.py): a training pass at 16 widths never seen,
#      then again, with transformers' sdpa and with the backend's widths in buckets, at both shapes, and
#      with cuDNN's attention off (PyTorch's memory-efficient kernel instead); at the packaged shape each
#      also with the driver's kernel cache off (CUDA_CACHE_DISABLE=1) and once with the CUDA libraries
#      dropped from the OS page cache, as a machine's first process runs: whether the first run's
#      warm-up (22.6% on the H100, 4-5% for later processes) is cuDNN's attention kernels compiled at
#      run time and kept by the driver, or libraries read from disk (each run a process of its own)
#  12. FSDP2 on one GPU (trainer=fsdp trainer.devices=1): rollouts on a copy of the gathered weights,
#      with graphs (the CUDA backend's choice, rollout/sharded_decoding.py), against through the
#      sharded policy, eagerly (benchmarks/fsdp_rollouts.py): each phase's mean time each way
# Each step gets what is left of LIMIT seconds; results (JSON, logs) go to OUT, the run of step 9 to RUN.
# All twelve do not fit one try: on an H200 on 2026-11-27 steps 1-5 took 294 s; later that day, in a
# session whose machine started in about 30 s, "2 3 5" with LIMIT=380 took 374 s and "7 8 9" 263 s;
# that evening "2 3 5" (step 3 with its second full run) took 365 s and "7" 207 s (TRL at 1.5B: 72 s).
# Reading a profile back (steps 3 and 5) took 18 s per run on the CPU. A session's 15 minutes hold
# two tries, run one after the other on the warm machine (it is given back after 30 s idle). On an
# H100 that night "2 3 5" took 349 s, and "2 8" then "7" in one call 405 s (the 7B shape: 60 s).
# The GPU tests build the tiny model from the packaged model's tokenizer: on a machine without a
# network, carry a cache holding the built tiny model (NGRPO_CACHE=<carried dir>, with tiny/ in it).
# No step has run since whole decoding steps are recorded (rollout/step_graphs.py): every figure
# before it had the explorer and bookkeeping launched between replays. Nor since (2026-11-27,
# night; docs/performance.md "Fewer kernels per layer, counted"): the sampler's blockwise scan
# (223 us per step at 1.5B before), the rotation's flip (no copy per layer), q|k|v and gate|up as
# one product on weights joined in place and the residual sums inside the products (752 model
# kernels per step counted where there were 842), the training passes' joined products
# (JointLinear; LoRA's JointLoraProduct, float32 gradients from out_dtype products), and the fix
# of LoRA runs recording their graphs again at every rollout. Steps 1 and 4's graphs-efficient and
# graphs-math rows say whether another attention kernel beats cuDNN's 13 us per layer at 1.5B; step
# 3's update column whether full fine-tuning's joined training passes pay on a host-bound GPU
# update (the CPU proxy had them 2.6% slower, for 17% fewer operations). Nor since (2026-11-28):
# masked passes' attention at a bounded set of widths (backends/width_buckets.py); step 11 says
# what a new width costs without them, which the fixed-length workloads of steps 3 and 5 never
# meet (random weights decode to the token limit). Nor since (2026-11-28, later): the frozen
# reference's projections joined as the policy's (full fine-tuning's logprobs column in steps 3 and
# 5: 211 -> 121 products a pass at the packaged shape), and host work cut from every rollout and
# update (LoRA's most: the address check, one walk to start a pass, the clip's parameters); step 3
# now prints each run's warm-up by phase. Nor since (2026-11-28, evening): under FSDP2 rollouts decode
# on a copy of the gathered weights, from graphs (rollout/sharded_decoding.py; step 2's
# test_sharded_decoding, step 12). What the next session runs:
#   STEPS="1 2 3 5"   LIMIT=420 (whole steps against the model's step alone at the packaged shape,
#                     the GPU tests, then the goals' table at both shapes; "1-5" took 294 s on an
#                     H200, "2 3 5" 349 s on an H100)
#   STEPS="4 8 9 11 12" LIMIT=420 (decoding modes at the 1.5B shape, 7B with LoRA, the command end to
#                     end, what a new pass width costs with and without the width buckets, and with cuDNN's
#                     attention and the driver's kernel cache off; FSDP2 over one GPU both ways last,
#                     about 90 s, cut first where time runs out)
#   On a machine without a network, `bash benchmarks/gpu_bundle.sh DEST` (here, where there is one) makes the
#   WHEELS, SOURCE, PROBLEMS and the NGRPO_CACHE holding the tiny model below in one folder; its header says
#   how to run this script with them.
#   TRACES    a directory for step 3's Chrome traces (a few MB each, gzipped; default: none written)
#   SOURCE    a directory with SmolLM2's tokenizer files and config.json (default: the packaged model's)
#   PROBLEMS  a .jsonl of problems, where reasoning-gym is not installed
#             (write it elsewhere first: python benchmarks/large_shapes.py --export-problems problems.jsonl)
#   WHEELS    a directory of wheels the machine lacks, installed first into /tmp/site (a machine without network)
#   STEPS     the steps to run (default all: "1 2 3 4 5 6 7 8 9 10 11 12"); without step 1 later runs use the
#             default backend (graphs), with it the eager one where recording failed
#   ACC=cpu TOK=8 LONG=8: a dry run of this script on the CPU (no graphs, no 7B), with MLflow and
#             reasoning-gym hidden as the GPU image lacks them (HIDE: the packages hidden)
#             DTYPE=float32 on a CPU without native bfloat16 products (AVX2 only), where bfloat16 runs several
#             times slower and most steps would reach their time limits (the models' dtype; default bfloat16;
#             in float32 the 1.5B shape's full fine-tuning, step 5, holds about 24 GB of weights and AdamW state)
set -u
ACC=${ACC:-gpu}; DTYPE=${DTYPE:-bfloat16}; TOK=${TOK:-40}; LONG=${LONG:-256}; LIMIT=${LIMIT:-540}; OUT=${OUT:-/tmp/gpu-checks}
PY=${PY:-python3}; MODELS=${MODELS:-/tmp/large-shapes}; RUN=${RUN:-$OUT/run}; STEPS=${STEPS:-1 2 3 4 5 6 7 8 9 10 11 12}
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
$PY benchmarks/large_shapes.py --build-only --shapes smollm2-135m qwen2.5-1.5b --dtype $DTYPE --accelerator $ACC --models "$MODELS" \
  ${SOURCE:+--source $SOURCE} || exit 1
G="$PY benchmarks/large_shapes.py --dtype $DTYPE --accelerator $ACC --models $MODELS ${SOURCE:+--source $SOURCE} ${PROBLEMS:+--problems $PROBLEMS}
  $(gpu && echo --bandwidth-gbs $BW)"
DEV=$(gpu && echo cuda || echo cpu); GRAPH_MODES=$(gpu && echo graphs graphs-model graphs-sdpa graphs-unfused graphs-efficient graphs-math)
D="$PY benchmarks/decoding_modes.py --device $DEV --dtype $DTYPE --bandwidth-gbs $BW ${PROBLEMS:+--problems $PROBLEMS}"
BACKEND=$(gpu && echo cuda || echo cpu)

if want 1; then
  echo "== 1. decoding modes, the packaged shape, $TOK tokens ($SECONDS s)"
  timeout -s INT "$(left 60)" $D --model $MODELS/smollm2-135m-$DTYPE --new-tokens "$TOK" --repeats 2 \
    --modes growing static $GRAPH_MODES --out "$OUT/decoding_small.json"
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
  echo "== 3. the packaged shape, $TOK tokens: full and LoRA on $BACKEND ($SECONDS s)"
  timeout -s INT "$(left 200)" $G --shapes smollm2-135m --modes full lora full --tokens "$TOK" --steps 4 $B \
    --profile ${TRACES:+--trace-dir $TRACES} --out "$OUT/small.json"
fi
if want 4; then
  echo "== 4. decoding modes, the Qwen2.5-1.5B shape, $LONG tokens ($SECONDS s)"
  timeout -s INT "$(left 120)" $D --model $MODELS/qwen2.5-1.5b-$DTYPE --new-tokens "$LONG" --repeats 1 \
    --modes growing static $GRAPH_MODES --out "$OUT/decoding_1.5b.json"
fi
if want 5; then
  echo "== 5. Qwen2.5-1.5B shape, $LONG tokens, micro-batches of 8, full and LoRA on $BACKEND ($SECONDS s)"
  timeout -s INT "$(left 260)" $G --shapes qwen2.5-1.5b --modes full lora --tokens "$LONG" --steps 3 --micro-batch 8 \
    $B --profile --out "$OUT/1.5b.json"
fi
if gpu && want 6; then
  echo "== 6. decoding: recorded graphs against torch.compile's, the packaged shape ($SECONDS s)"
  timeout -s INT "$(left 120)" $D --model $MODELS/smollm2-135m-$DTYPE --new-tokens "$TOK" --repeats 2 \
    --modes static graphs compile --out "$OUT/decoding_compile_small.json"
  echo "== 6b. decoding: recorded graphs against torch.compile's, the Qwen2.5-1.5B shape ($SECONDS s)"
  timeout -s INT "$(left 150)" $D --model $MODELS/qwen2.5-1.5b-$DTYPE --new-tokens "$LONG" --repeats 1 \
    --modes static graphs compile --out "$OUT/decoding_compile_1.5b.json"
fi
if gpu && want 7; then
  if $PY -c "import trl" 2>/dev/null; then
    echo "== 7. TRL's GRPOTrainer on step 3's workload (its full fine-tuning row is ours; gpu_vs_trl.sh: both shapes) ($SECONDS s)"
    timeout -s INT "$(left 90)" $PY benchmarks/vs_trl.py --accelerator gpu --dtype $DTYPE --sides trl --runs 1 \
      --no-saves --bandwidth-gbs $BW ${PROBLEMS:+--problems $PROBLEMS} --model $MODELS/smollm2-135m-$DTYPE \
      --tokens "$TOK" --steps 4 --out "$OUT/trl_small.json"
    echo "== 7a. TRL's GRPOTrainer on step 5's workload (its full fine-tuning row is ours) ($SECONDS s)"
    timeout -s INT "$(left 120)" $PY benchmarks/vs_trl.py --accelerator gpu --dtype $DTYPE --sides trl --runs 1 \
      --no-saves --bandwidth-gbs $BW ${PROBLEMS:+--problems $PROBLEMS} --model $MODELS/qwen2.5-1.5b-$DTYPE \
      --tokens "$LONG" --micro-batch 8 --steps 3 --out "$OUT/trl_1.5b.json"
  fi
  echo "== 7b. the packaged shape, $TOK tokens, full fine-tuning on the eager backend ($SECONDS s)"
  timeout -s INT "$(left 60)" $G --shapes smollm2-135m --modes full --tokens "$TOK" --steps 4 \
    --extra backend.name=cuda_eager --out "$OUT/small_eager.json"
fi
if gpu && want 8; then
  echo "== 8. Qwen2.5-7B shape, LoRA, gradient checkpointing, $LONG tokens, on $BACKEND ($SECONDS s)"
  timeout -s INT "$(left 200)" $G --shapes qwen2.5-7b --modes lora --tokens "$LONG" --steps 2 --micro-batch 8 \
    --extra backend.name=$BACKEND model.gradient_checkpointing=true --out "$OUT/7b.json"
fi
if want 9; then
  echo "== 9. ngrpo train: N-GRPO, validation, checkpoint; then resume=last ($SECONDS s)"
  DATA=${PROBLEMS:+data=files data.train=$PROBLEMS data.val=$PROBLEMS data.val_limit=32}
  CLI="$PY -m ngrpo_lightning.commands.launch train experiment=ngrpo trainer=$ACC model.name_or_path=$MODELS/smollm2-135m-$DTYPE
    model.dtype=$DTYPE $DATA data.prompts_per_step=4 trainer.val_check_interval=2 rollout.max_new_tokens=$TOK
    logger=none output_dir=$RUN trainer.enable_progress_bar=false $(gpu && echo backend.name=$BACKEND)"
  timeout -s INT "$(left 60)" $CLI trainer.max_steps=2 > "$RUN.cli.log" 2>&1; echo "rc=$?"; tail -3 "$RUN.cli.log"
  timeout -s INT "$(left 45)" $CLI trainer.max_steps=3 resume=last > "$RUN.resume.log" 2>&1; echo "rc=$?"; tail -3 "$RUN.resume.log"
fi
if want 10; then
  echo "== 10. a group's prompt once or per row: the log-prob passes both ways, and the backend's choice ($SECONDS s)"
  P="$PY benchmarks/prompt_sharing.py --device $DEV --dtype $DTYPE ${PROBLEMS:+--problems $PROBLEMS}"
  timeout -s INT "$(left 45)" $P --model $MODELS/smollm2-135m-$DTYPE --tokens "$TOK" --out "$OUT/sharing_small.json"
  timeout -s INT "$(left 60)" $P --model $MODELS/qwen2.5-1.5b-$DTYPE --tokens "$LONG" --out "$OUT/sharing_1.5b.json"
fi
if want 11; then
  echo "== 11. a new pass width's cost: transformers' sdpa against the backend's width buckets ($SECONDS s)"
  S="$PY benchmarks/attention_shapes.py --dtype $DTYPE"
  # and each with cuDNN's attention off, and with the driver's kernel cache off (a machine's first process)
  timeout -s INT "$(left 90)" $S --model $MODELS/smollm2-135m-$DTYPE --widths 100:200 --calls "$(gpu && echo 16 || echo 3)" \
    --runs $(gpu && echo sdpa sdpa_gqa sdpa_gqa,no-cudnn sdpa,cold sdpa_gqa,cold sdpa_gqa,no-cudnn,cold \
    sdpa_gqa,cold-files || echo sdpa sdpa_gqa,no-cudnn,cold,cold-files) --out "$OUT/shapes_small.json"
  gpu && timeout -s INT "$(left 90)" $S --model $MODELS/qwen2.5-1.5b-$DTYPE --widths 150:360 --calls 16 \
    --runs sdpa sdpa_gqa sdpa_gqa,no-cudnn --out "$OUT/shapes_1.5b.json"
fi
if want 12; then
  echo "== 12. FSDP2 on one GPU: rollouts on a copy of the gathered weights against through the policy ($SECONDS s)"
  # the packaged shape, fixed-length rollouts, each way a process of its own: each phase's mean from
  # Lightning's simple profiler, and the line each run printed about its rollouts (a CPU dry run: fsdp_cpu)
  timeout -s INT "$(left 150)" $PY benchmarks/fsdp_rollouts.py --accelerator $ACC --model $MODELS/smollm2-135m-$DTYPE \
    --tokens "$TOK" --runs 1 --timeout 70 ${PROBLEMS:+--problems $PROBLEMS} --out "$OUT/fsdp_rollouts.json" | tail -5
fi
echo "== done ($SECONDS s)"
