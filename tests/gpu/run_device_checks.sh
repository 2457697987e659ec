#!/usr/bin/env bash
# The GPU checks in one run (about 10 minutes on an H200): kernel tests against the
# reference, kernel bandwidth, then the Llama-3.2-1B-shaped workload (256 requests x
# 512 prompt x 128 output tokens, EOS ignored) on Cleave, transformers `generate`
# and `generate_batch`, structured-output overhead, and decode step time against the memory roofline.
# Results land in $OUT (default /tmp/cleave-gpu) as JSON and logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cleave-gpu}
PY=${PY:-python3}
MODEL=${MODEL:-/tmp/llama-3.2-1b-random}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -m pytest -q -m gpu tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log"
$PY -m shared.bench.kernel_bench > "$OUT/kernel_bench.json" 2> "$OUT/kernel_bench.err"
[ -f "$MODEL/config.json" ] || $PY -m shared.bench.make_checkpoint "$MODEL" --device cuda
W=(--model "$MODEL" --dtype bfloat16 --device cuda --max-model-len 1024 --num-prompts 256 --prompt-len 512 512 --output-len 128 128)
$PY -m shared.bench throughput "${W[@]}" --backend cleave > "$OUT/throughput_cleave.json" 2> "$OUT/throughput_cleave.err"
$PY -m shared.bench structured --model "$MODEL" --dtype bfloat16 --device cuda --max-model-len 1024 --batch-size 128 \
    --prompt-len 512 --output-len 128 > "$OUT/structured.json" 2> "$OUT/structured.err"
$PY -m shared.bench.decode_step --model "$MODEL" --dtype bfloat16 --device cuda --max-model-len 1024 --batch-sizes 64 256 \
    --context-len 576 > "$OUT/decode_step.json" 2> "$OUT/decode_step.err"
$PY -m shared.bench throughput "${W[@]}" --backend hf --hf-batch-size 256 > "$OUT/throughput_hf.json" 2> "$OUT/throughput_hf.err"
$PY -m shared.bench throughput "${W[@]}" --backend hf-cb > "$OUT/throughput_hf_cb.json" 2> "$OUT/throughput_hf_cb.err"
tail -n +1 "$OUT"/*.json
