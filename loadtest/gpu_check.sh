#!/usr/bin/env bash
# One-shot CUDA check (under 8 minutes) for a machine with an NVIDIA GPU and torch installed.
#
#   loadtest/gpu_check.sh OUT_DIR
#
# Installs steadyserve against the torch already present, then writes to OUT_DIR:
#   env.txt          nvidia-smi, torch/CUDA versions, clocks and throttle reasons
#   pytest.txt       the integration tests run on CUDA (fp16 buffers, pinned staging, streams)
#   server.log       a steadyserve started on CUDA: eager init, alloc conf, warm-up
#   bench.txt, bench/ a 20 s closed-loop run at 64 connections (table and JSON)
#   metrics.txt      /metrics after the run (allocator, pool, batch sizes)
#   debug_pool.json  per-shape slots and measured compute
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PORT=${PORT:-8077}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi || true
  nvidia-smi -q -d CLOCK,PERFORMANCE,TEMPERATURE,POWER 2>/dev/null | head -80 || true
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available(), torch.cuda.get_device_name(0))'
} >"$OUT/env.txt" 2>&1

# Keep the GPU machine's own torch: pin the install to exactly that version.
$PY -c 'import torch; print(f"torch=={torch.__version__}")' >"$OUT/torch-constraint.txt"
$PY -m pip install -q -c "$OUT/torch-constraint.txt" -e '.[dev]' >"$OUT/pip.txt" 2>&1 \
  || { echo "install failed"; tail -20 "$OUT/pip.txt"; exit 1; }

STEADY_DEVICE=cuda timeout 240 $PY -m pytest -q -ra tests/integration tests/unit \
  -p no:cacheprovider >"$OUT/pytest.txt" 2>&1
echo "pytest exit $?" >>"$OUT/pytest.txt"

STEADY_DEVICE=cuda STEADY_DEBUG_TOKEN=gpucheck $PY -m app.cli serve --port "$PORT" \
  >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 180); do
  curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null && break
  kill -0 "$SERVER_PID" 2>/dev/null || break
  sleep 1
done
curl -s "http://127.0.0.1:$PORT/readyz" >"$OUT/readyz.json"
timeout 60 $PY -m loadtest run --url "http://127.0.0.1:$PORT/infer" --mode closed \
  --concurrency 64 --duration 20s --words fixed:12 --out "$OUT/bench" --no-plots \
  >"$OUT/bench.txt" 2>&1
curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/metrics.txt"
curl -s -H 'Authorization: Bearer gpucheck' "http://127.0.0.1:$PORT/debug/pool" \
  >"$OUT/debug_pool.json"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID"
echo "server exit $?" >>"$OUT/server.log"
nvidia-smi -q -d CLOCK,PERFORMANCE 2>/dev/null | head -40 >>"$OUT/env.txt" || true
echo "done: $(ls "$OUT")"
