#!/usr/bin/env bash
# The whole GPU check in one command (run in the repo root on the GPU machine, after
# install.sh has installed Ray): the gpu-marked tests, then the GPU benchmarks. Writes
# $OUT/junit.xml, $OUT/timings.json, $OUT/pytest.log and $OUT/bench.log. Fits in one
# 10-minute command: the tests get PHALANX_KIT_TEST_S (default 420 s), each benchmark
# PHALANX_KIT_BENCH_S (default 50 s). Exits with pytest's status.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
OUT="${OUT:-/tmp/phalanx_kit_out}"
mkdir -p "$OUT"
export PYTHONPATH="${PHALANX_SITE:-/tmp/phalanx_site}:$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)" || true

t0=$(date +%s)
timeout "${PHALANX_KIT_TEST_S:-420}" python3 -m pytest -m gpu tests/gpu --confcutdir tests/gpu \
    -p no:cacheprovider -q -rs --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
t1=$(date +%s)
: >"$OUT/bench.log"
for bench in bench_ipc bench_train bench_generate; do
    timeout "${PHALANX_KIT_BENCH_S:-50}" python3 "$here/$bench.py" 2>&1 | tee -a "$OUT/bench.log"
done
t2=$(date +%s)
python3 "$here/collect_timings.py" "$OUT/junit.xml" "$OUT/bench.log" "$OUT/timings.json" \
    "tests=$((t1 - t0))" "benchmarks=$((t2 - t1))"
cat "$OUT/timings.json"
exit "$rc"
