#!/usr/bin/env bash
# Times the README's first command on a fresh virtual environment and prints the BLEU it reaches.
#   bash scripts/time_default.sh [WORKDIR]     (default: a new temporary directory)
# Install time (pip) and run time (python train.py: data, vocabulary, compilation, training, decoding) are
# reported apart; the target is the run time under 10 minutes with test BLEU >= 90 on a 2-core CPU.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,5p' "$0"; exit 0; fi
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
workdir=${1:-$scratch/demo}
python3 -m venv "$scratch/venv"
source "$scratch/venv/bin/activate"
SECONDS=0
pip install -q -e .
install_seconds=$SECONDS
SECONDS=0
python train.py --workdir="$workdir" | tee "$scratch/train.log"
run_seconds=$SECONDS
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "pip install -e . : ${install_seconds} s"
echo "python train.py --workdir=$workdir : ${run_seconds} s"
grep -E "^(valid|test) BLEU" "$scratch/train.log"
