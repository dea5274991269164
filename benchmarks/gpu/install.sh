#!/usr/bin/env bash
# On the GPU machine, once per carried batch (in the repo root):
#   bash benchmarks/gpu/install.sh .gpu_wheels/batch1
# Stages the batch's parts in $PHALANX_WHEEL_STAGE (default /tmp/phalanx_wheels, which
# outlives the command while the machine stays up); after the last batch it reassembles
# the wheels, checks their SHA-256, installs them and phalanx (--no-deps: torch is the
# machine's) into $PHALANX_SITE (default /tmp/phalanx_site) and prints the PYTHONPATH.
set -euo pipefail
if [ $# -ne 1 ]; then
    echo "usage: $0 BATCH_DIR   (a .gpu_wheels/batchN folder made by prepare_wheels.py)" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python3 "$here/wheelkit.py" install "$1" \
    --stage "${PHALANX_WHEEL_STAGE:-/tmp/phalanx_wheels}" \
    --target "${PHALANX_SITE:-/tmp/phalanx_site}" --repo "$repo"
