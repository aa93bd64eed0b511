#!/usr/bin/env bash
# duet's GPU path in one bounded call, for a lent GPU machine (no network there): the CUDA tests, then
# make bench-kernels, the quantized GEMMs, make bench-decode (a Llama-3.2-1B-shaped random model) and the KV tier
# copies.
#
#   bash bench/gpu_check.sh [stage ...]      # stages: env tests kernels quant decode tiers (the default), fp8, gemm, prefill
#
# quant (issue 48, ~2 min): python -m bench.kernels.quant_gemm: W4A16 (Q4_0) and W8A16 (Q8_0) Triton GEMMs vs bf16
# cuBLAS and vs dequantize + cuBLAS at M = 1 .. 1024 on Llama-8B shapes; its "crossover" lines say where
# kernels/quant_gemm.py DEQUANT_GEMM_ROWS (a placeholder until then) should be, "ratio:" the W4A16 speedup at M = 1
# (the kernels' correctness on the GPU is in the tests stage: tests/kernels/test_quant_*.py and
# tests/engine/loading/test_quantized_triton.py).
#
# fp8 (issue 49, ~1 min): python -m bench.kernels.fp8_gemm: FP8 checkpoints' W8A8 linears (torch._scaled_mm, per-row
# and 128x128 block scales) vs bf16 cuBLAS at M = 1 .. 2048 on Llama-8B shapes; "ratio:" per-row FP8 over bf16 at
# M = 2048 (goal >= 1.5). Each output is first checked against the fp32 reference on the GPU.
#
# prefill (issue 51, ~3 min): the prefill attention tests compiled on the GPU (every tile config, pinned), then
# python -m bench.kernels.triton_kernels --prefill (the autotuned kernel, each config,
# and SDPA's flash, cuDNN and default backends at 4 x 2048, 1 x 16384 and 4 x (1024 + 1024 cached) tokens, paged blocks of 16 and 128).
#
# Python packages the GPU image lacks travel as wheels in .whl/ (see docs/benchmarks.md "GPU runs": gguf,
# llguidance, jsonschema + its three, redis, nixl + a trimmed nixl_cu13); they are installed into /tmp/site.
# Each stage has its own time limit and writes $OUT/<stage>.log (OUT defaults to build/gpu); the summary
# prints each stage's exit code and the lines that carry its figures.
set -u
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
STAGES=${*:-env tests kernels quant decode tiers}
PY=${PYTHON:-python3}
export PYTHONPATH=/tmp/site:$PWD DUET_GPU_CHECK=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; }
fi
MODEL_1B=/tmp/duet-llama-1b
if [[ " $STAGES " == *" decode "* ]]; then  # built on the CPUs while the tests use the GPU
    $PY -c "
from engine.loading.tiny import make_tiny_model
make_tiny_model('$MODEL_1B', arch='llama', hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                intermediate_size=8192, dtype='bfloat16', max_position_embeddings=4096)" > "$OUT/model.log" 2>&1 &
    MODEL_PID=$!
fi

stage() {  # stage NAME LIMIT_S CMD...: run, bounded; print rc, time and the figure lines
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)"
    grep -E "ratio:|crossover|x[0-9.]+ \\(geometric|passed|failed|error|Error|MISMATCH|tok/s|GB/s|TFLOP|HBM|check |captured" "$OUT/$name.log" \
        | grep -v "^\s*$" | tail -n 40
}

for s in $STAGES; do
    case $s in
    env)
        {
            nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
            $PY -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton',
                    triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
            $PY -c "import nixl, gguf, llguidance, redis, jsonschema; print('carried wheels import')"
            command -v cc gcc nvcc
        } > "$OUT/env.log" 2>&1
        cat "$OUT/env.log"
        ;;
    tests)
        xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
        stage tests 240 $PY -m pytest -q -p no:cacheprovider --timeout 150 $xdist -rfE \
            tests/kernels tests/engine/test_cuda_engine.py tests/engine/test_cuda_features.py \
            tests/engine/test_decode_graphs.py tests/engine/models/test_kernel_backends.py tests/engine/models/test_moe.py \
            tests/engine/models/test_partial_rotary.py tests/engine/test_longrope_sets.py tests/kvtransfer/test_kv_nixl_transfer.py \
            tests/engine/loading/test_quantized_triton.py \
            --ignore tests/kernels/test_cpu_native.py --ignore tests/kernels/test_sm90_compile.py
        ;;
    kernels)
        stage kernels 120 $PY -m bench.kernels.triton_kernels
        ;;
    quant)
        stage quant 200 $PY -m bench.kernels.quant_gemm --device cuda --formats Q4_0 Q8_0
        ;;
    decode)
        [ -n "${MODEL_PID:-}" ] && wait "$MODEL_PID"
        tail -3 "$OUT/model.log"
        stage decode 180 $PY -m bench.engine.decode --model "$MODEL_1B" --dtype bfloat16 --device cuda \
            --json "$OUT/decode.json"
        ;;
    fp8)
        stage fp8 120 $PY -m bench.kernels.fp8_gemm --device cuda
        ;;
    tiers)
        stage tiers 60 $PY -m bench.kv.tiers_copy --repeats 3
        ;;
    prefill)
        xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
        stage prefill-tests 200 $PY -m pytest -q -p no:cacheprovider --timeout 150 $xdist -rfE \
            tests/kernels/test_prefill_attention.py
        stage prefill 240 $PY -m bench.kernels.triton_kernels --prefill
        ;;
    gemm)  # our GEMM's tile configs at decode shapes in CUDA graphs (~40 s)
        stage gemm 120 $PY -m bench.kernels.gemm_sweep
        ;;
    *) echo "unknown stage $s"; exit 2 ;;
    esac
done
