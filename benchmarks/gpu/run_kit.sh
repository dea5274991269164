#!/usr/bin/env bash
# The whole GPU check (run in the repo root on the GPU machine, after install.sh has
# installed Ray): the gpu-marked tests, then the GPU benchmarks at real model sizes.
#   bash benchmarks/gpu/run_kit.sh [tests] [BENCH ...]     (no argument: everything)
# BENCH is a name of the BENCHES table below (ORDER lists the default ones). Writes
# $OUT/junit.xml, $OUT/timings.json, $OUT/pytest.log and $OUT/bench.log. The tests get
# PHALANX_KIT_TEST_S (default 420 s) and run in PHALANX_KIT_WORKERS (default 4) pytest-xdist
# processes, each benchmark its LIMIT (seconds). Exits with
# pytest's status (0 when the tests were not asked for).
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

declare -A BENCHES=(
    [train_0.5b]="bench_train.py --model qwen2.5-0.5b --mbs 8 --profile"
    [train_0.5b_compile]="bench_train.py --model qwen2.5-0.5b --mbs 8 --compile on --profile"
    [train_1.5b]="bench_train.py --model qwen2.5-1.5b --mbs 8 --profile"
    [train_1.5b_compile]="bench_train.py --model qwen2.5-1.5b --mbs 8 --compile on --profile"
    [train_1.5b_varied]="bench_train.py --model qwen2.5-1.5b --mbs 8 --lengths varied"
    [train_1.5b_eager]="bench_train.py --model qwen2.5-1.5b --mbs 8 --logprob-kernel eager"
    [train_1.5b_regather]="bench_train.py --model qwen2.5-1.5b --mbs 8 --gather-once off"
    [logprobs]="bench_logprobs.py"
    [refit_1.5b]="bench_refit.py --model qwen2.5-1.5b"
    [refit_1.5b_narrow]="bench_refit.py --model qwen2.5-1.5b --narrow --repeats 21"
    [generate_0.5b]="bench_generate.py --model qwen2.5-0.5b --prompts 8 --samples 8 --new 512 --prompt-len 64 --repeats 2"
    [generate_static_0.5b]="bench_generate.py --model qwen2.5-0.5b --prompts 8 --samples 8 --new 512 --prompt-len 64 --repeats 2 --static"
    [grpo_0.5b]="bench_grpo.py --model qwen2.5-0.5b"
    [keep_state_0.5b]="bench_keep_state.py --model qwen2.5-0.5b"
    [ipc]="bench_ipc.py"
)
declare -A LIMIT=(
    [train_0.5b]=90 [train_0.5b_compile]=150 [train_1.5b]=120 [train_1.5b_compile]=180 [train_1.5b_varied]=90 [train_1.5b_eager]=90 [train_1.5b_regather]=90 [logprobs]=90 [refit_1.5b]=90
    [refit_1.5b_narrow]=60
    [generate_0.5b]=120 [generate_static_0.5b]=400 [grpo_0.5b]=300 [ipc]=60
    [keep_state_0.5b]=120
)
# generate_static_0.5b is not in the default set: HF compiles its static-cache step for minutes
ORDER=(train_0.5b train_0.5b_compile train_1.5b train_1.5b_compile train_1.5b_varied logprobs refit_1.5b refit_1.5b_narrow generate_0.5b grpo_0.5b keep_state_0.5b ipc)
run_tests=0
benches=()
if [ $# -eq 0 ]; then
    run_tests=1
    benches=("${ORDER[@]}")
fi
for arg in "$@"; do
    if [ "$arg" = tests ]; then
        run_tests=1
    elif [ -n "${BENCHES[$arg]+x}" ]; then
        benches+=("$arg")
    else
        echo "run_kit.sh: unknown argument '$arg' (tests or one of: ${ORDER[*]})" >&2
        exit 2
    fi
done

t0=$(date +%s)
rc=0
if [ "$run_tests" = 1 ]; then
    # The tests run in PHALANX_KIT_WORKERS pytest-xdist processes (the machine has 16
    # cores and one GPU; each test needs a few hundred MiB of it): the two Ray tests take
    # 45 s each, so one process would spend three minutes where four spend about one.
    workers=${PHALANX_KIT_WORKERS:-4}
    par=()
    if [ "$workers" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
        par=(-n "$workers" --dist load)
    fi
    timeout "${PHALANX_KIT_TEST_S:-420}" python3 -m pytest -m gpu tests/gpu --confcutdir tests/gpu \
        -p no:cacheprovider -p no:benchmark -q -rs "${par[@]}" --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
fi
t1=$(date +%s)
: >"$OUT/bench.log"
for name in "${benches[@]}"; do
    echo "== $name: ${BENCHES[$name]}" | tee -a "$OUT/bench.log"
    b0=$(date +%s)
    # shellcheck disable=SC2086  # the table's entries are word lists
    timeout "${LIMIT[$name]}" python3 "$here/"${BENCHES[$name]} 2>&1 | tee -a "$OUT/bench.log"
    echo "== $name: exit ${PIPESTATUS[0]} in $(($(date +%s) - b0)) s" | tee -a "$OUT/bench.log"
done
t2=$(date +%s)
python3 "$here/collect_timings.py" "$OUT/junit.xml" "$OUT/bench.log" "$OUT/timings.json" \
    "tests=$((t1 - t0))" "benchmarks=$((t2 - t1))"
cat "$OUT/timings.json"
exit "$rc"
