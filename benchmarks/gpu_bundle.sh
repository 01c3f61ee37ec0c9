#!/usr/bin/env bash
# What gpu_checks.sh needs on a GPU machine without a network, made
# here, where there is one, into one folder to carry there (about 30 MiB; 70 with MLFLOW=1):
#   DEST/wheels          the packages a CUDA image with torch, transformers, lightning, torchmetrics,
#                        accelerate, pandas, pyarrow and pytest lacks, for Python PYVER on manylinux x86-64:
#                        the config (omegaconf, hydra), answer checking (math-verify), LoRA (peft), TRL and
#                        the datasets it reads; MLFLOW=1 adds MLflow (else the scripts run with logger=none)
#   DEST/source          the packaged model's tokenizer and config, without its weights: the scripts build
#                        models of real shapes from them, randomly initialised
#   DEST/problems.jsonl  the built-in task's problems (reasoning-gym is not carried)
#   DEST/cache/tiny      the built tiny model, which the GPU tests otherwise build from the packaged model
# The versions are the ones these scripts last ran with on such an image; the wheels are installed there
# without their dependencies (--no-deps), so a package the image lacks must be named here.
# Usage, from the project's root after `make setup-dev`:
#   bash benchmarks/gpu_bundle.sh DEST            (PYVER=3.12 by default: the Python of the GPU machine)
# There (DEST carried beside the project):
#   export NGRPO_CACHE=$PWD/DEST/cache; WHEELS=DEST/wheels SOURCE=DEST/source PROBLEMS=$PWD/DEST/problems.jsonl \
#     STEPS="1 2 3 5" LIMIT=420 bash benchmarks/gpu_checks.sh
set -euo pipefail
DEST=${1:?usage: bash benchmarks/gpu_bundle.sh DEST}
PY=${PY:-.venv/bin/python}; PYVER=${PYVER:-3.12}
[ -x "$PY" ] || { echo "gpu_bundle.sh: $PY not found: run make setup-dev first (or set PY)" >&2; exit 2; }
rm -rf "$DEST/wheels" "$DEST/source" "$DEST/cache/tiny" && mkdir -p "$DEST/wheels" "$DEST/source" "$DEST/cache"

core=(omegaconf==2.3.1 hydra-core==1.3.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0 rapidfuzz==3.14.6
      gguf==0.19.0 pytest-timeout==2.4.0)
lora_trl=(peft==0.21.2 trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 xxhash==3.6.0
          fsspec==2026.2.0 requests urllib3 idna charset_normalizer certifi)
mlflow=(mlflow==3.17.2 mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 alembic sqlalchemy flask flask-cors graphene
        graphql-core graphql-relay gunicorn huey docker skops cryptography databricks-sdk opentelemetry-api
        opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions cachetools gitpython gitdb smmap
        sqlparse python-dotenv fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
        itsdangerous blinker mako google-auth pyasn1 pyasn1-modules rsa greenlet)
wanted=("${core[@]}" "${lora_trl[@]}")
[ "${MLFLOW:-0}" = 1 ] && wanted+=("${mlflow[@]}")
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform any)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$DEST/wheels" "${wanted[@]}" 2> >(grep -v "^WARNING: Location" >&2)
# antlr4-python3-runtime (omegaconf's parser) is published as source only: its pure-Python wheel is built here
"$PY" -m pip wheel -q --no-deps -w "$DEST/wheels" antlr4-python3-runtime==4.9.3 2> >(grep -v "^WARNING: Location" >&2)

"$PY" - "$DEST" <<'EOF'
import shutil, sys
from pathlib import Path
from ngrpo_lightning.models.loading import packaged_model_dir

dest = Path(sys.argv[1])
for f in packaged_model_dir("smollm2-135m-instruct").iterdir():  # built here once if missing
    if f.is_file() and f.suffix != ".safetensors":
        shutil.copy2(f, dest / "source" / f.name)
shutil.copytree(packaged_model_dir("tiny"), dest / "cache" / "tiny")
EOF
"$PY" benchmarks/harness.py problems "$DEST/problems.jsonl"
du -sh "$DEST"; ls "$DEST/wheels" | wc -l | xargs echo "wheels:"
