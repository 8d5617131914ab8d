#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one command, for a machine with one CUDA GPU whose python3
# has torch, transformers, safetensors, einops, pytest and hypothesis (optree may come as a
# wheel in .whl/). Logs and results go to $OUT (default ./gpu-out).
#   bash tools/gpu_check.sh [tests] [bench]     (TESTS=-k expression, ARMS=comma list: benchmarks/gpu.py,
#                                               BENCH_ARGS=more of its arguments, e.g. --profile; CALIBRATE= skips --calibrate)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
what=${*:-tests bench}
for part in $what; do
  case $part in
    tests) timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -p no:logging -rP tests/test_cuda.py ${TESTS:+-k "$TESTS"} 2>&1 | tee "$OUT/tests.log" | grep -a "passed\|failed\|FAILED\|Error\|update=host" | tail -25 ;;
    bench) timeout ${BENCH_S:-270} python3 benchmarks/gpu.py --out "$OUT/gpu.json" ${CALIBRATE---calibrate} --rounds ${ROUNDS:-3} --steps 3 --arms ${ARMS:-torch,fsdp2,fs,fs-fused,fs-compile} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "Warning\|USDT" | tail -40 ;;
  esac
done
