#!/usr/bin/env bash
# The larger parity comparison for a GPU machine, as one prepared script (aim: < 10 min
# on one H200). Installs atoll without dependencies (the machine has torch and numpy but
# reaches no registry), then runs ddp, diloco and streaming at H=30 on the 'base' preset
# (~38M parameters, seq 512). Results go to $OUT (or ./runs when OUT is unset).
#   bash bench/gpu_parity.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-600}
out=${OUT:-runs}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONUNBUFFERED=1 python3 bench/parity.py --device cuda --preset base --replicas 4 \
  --batch-size 32 --steps "$steps" --H 30 --eval-batches 32 --json "$out/gpu-parity.json" \
  2>&1 | tee "$out/gpu-parity.log"
