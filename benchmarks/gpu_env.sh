# Sourced by gpu_checks.sh after it sets its defaults:
# `left N` (at most N of the LIMIT seconds that remain), the carried wheels installed (WHEELS), and
# the environment it runs in, and BW, the GPU's memory bandwidth in GB/s for the floors
# (BANDWIDTH, else the data sheet's for an H100 SXM or an H200, named by nvidia-smi). Expects PY and LIMIT.
left() { local l=$((LIMIT - SECONDS)); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
  # run from the source tree: the installed package maps callbacks/ to ngrpo_lightning.callbacks
  [ -e ngrpo_lightning/callbacks ] || ln -s "$PWD/callbacks" ngrpo_lightning/callbacks
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# a dry run on the CPU (ACC=cpu) hides the packages the GPU image lacks, so that it fails where the
# GPU run would: HIDE names them (empty: hide nothing)
if [ "${ACC:-gpu}" = cpu ] && [ -n "${HIDE-mlflow reasoning_gym}" ]; then
  HIDDEN=$(mktemp -d); printf 'import sys\nfor name in "%s".split():\n    sys.modules[name] = None\n' \
    "${HIDE-mlflow reasoning_gym}" > "$HIDDEN/sitecustomize.py"
  export PYTHONPATH=$HIDDEN:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU_NAME" in *H200*) BW=${BANDWIDTH:-4800} ;; *) BW=${BANDWIDTH:-3350} ;; esac
