# Sourced by the device scripts (gpu_checks.sh, gpu_vs_trl.sh) after they set their defaults:
# `left N` (at most N of the LIMIT seconds that remain), the carried wheels installed (WHEELS), and
# the environment both scripts run in. Expects PY and LIMIT.
left() { local l=$((LIMIT - SECONDS)); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
  # run from the source tree: the installed package maps callbacks/ to ngrpo_lightning.callbacks
  [ -e ngrpo_lightning/callbacks ] || ln -s "$PWD/callbacks" ngrpo_lightning/callbacks
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
