#!/bin/bash
# The GPU checks as one prepared script, sized for one H200 and a 10-minute command
# (meant for about 8 minutes with compilation, not yet run on a GPU; every step has its own time limit, and all end by
# GPU_CHECKS_SECONDS, 540 by default):
#   1. the imports, and the attention implementations agree on the GPU (cudnn flash attention against the
#      reference in bf16; the float32 tests at full matmul precision, not TF32);
#   2. training-step throughput and MFU of 'base' in bfloat16 at ~25k target tokens per step (96 rows x 256
#      source x 256 target tokens, vocab 32000), attention cudnn and then xla;
#   3. beam-4 decoding of 3,003 sentences (newstest2014's size) with a base-size model (float32, then
#      decode.weights=bfloat16), then MBR's device part:
#      16 epsilon samples per sentence of 750 sentences (as many hypotheses as beam 4's batch);
#   4. the same training step of 'base' as a decoder-only model (14 layers: the parameters of 6 + 6), as a masked
#      LM (6 encoder layers) and with 8 experts (top-2, every other layer), xla attention, each once;
#   5. the hybrid state-space decoder (decoder_attention=ssm,ssm,dense): base's training step and beam-4 decoding,
#      then decoding time per token and memory against length, ssm against dense (scripts/benchmark_attention.py);
#   6. the same training steps for 'big'.
# Results: $OUT/gpu_checks.jsonl (one JSON line per benchmark) and $OUT/gpu_checks.log ($OUT: runs/gpu_checks
# unless set).
#
# On a GPU machine without network: bring wheels of what its image lacks, made once on a machine with network by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform any -d .whl ml-collections grain==0.2.18 array-record portpicker
# copy `.whl/` beside this repository's root there and run `bash scripts/gpu_checks.sh`. GPU_CHECKS_SMOKE=1 runs the same commands at toy
# sizes with xla attention on any machine (the plumbing only: about a minute on a 2-core CPU).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_checks}
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
JSONL="$OUT/gpu_checks.jsonl"
if [ -d .whl ] && ! python3 -c "import grain, ml_collections" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl/site .whl/*.whl \
    && export PYTHONPATH=$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

if [ "${GPU_CHECKS_SMOKE:-0}" = 1 ]; then
  ATTENTION=(xla)
  TRAIN=(--batch=4 --source_length=16 --target_length=16 --vocab_size=500 --steps=2 --warmup=1 --peak_size=256
         --config.model.emb_dim=64 --config.model.mlp_dim=128 --config.model.num_heads=2
         --config.model.num_encoder_layers=1 --config.model.num_decoder_layers=1)
  DECODE=(--batch=8 --source_length=8 --new_tokens=12 --repeats=1 --vocab_size=500 --config.model.emb_dim=64
          --config.model.mlp_dim=128 --config.model.num_heads=2 --config.model.num_encoder_layers=1
          --config.model.num_decoder_layers=1)
  TESTS=(tests/attention_test.py -k "xla or cudnn")
  LENGTHS=(--min_length=8 --max_length=16 --repeats=1 --config.model.emb_dim=64 --config.model.mlp_dim=128
           --config.model.num_heads=2 --config.model.num_encoder_layers=1 --config.model.num_decoder_layers=1)
else
  ATTENTION=(cudnn xla)
  TRAIN=(--batch=96 --source_length=256 --target_length=256 --vocab_size=32000 --steps=15 --warmup=3)
  DECODE=(--batch=3003 --source_length=32 --new_tokens=40 --repeats=2 --vocab_size=32000)
  TESTS=(tests/attention_test.py)
  LENGTHS=(--min_length=128 --max_length=8192 --repeats=2 --max_seconds=20)
fi

END=$((SECONDS + ${GPU_CHECKS_SECONDS:-540}))
step() {  # step LIMIT_SECONDS TITLE COMMAND...: run within the limit and the deadline, log, go on whatever happens
  local limit=$1 title=$2 left=$((END - SECONDS))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "== $title: skipped, ${left}s left before the deadline" | tee -a "$LOG"
    return
  fi
  echo "== $title ($(date -u +%H:%M:%S), limit ${limit}s)" | tee -a "$LOG"
  timeout -k 10 "$limit" "$@" 2>&1 | grep --line-buffered -v "^[IW][0-9]\{4\} " | tee -a "$LOG"
  echo "== rc ${PIPESTATUS[0]}" | tee -a "$LOG"
}
train() {  # train CONFIG: the training-step benchmark in bfloat16 with each attention implementation
  for attention in "${ATTENTION[@]}"; do
    step 150 "train $1 bfloat16 attention=$attention" python3 scripts/benchmark.py --mode=train \
      --config="configs/$1.py" --config.model.dtype=bfloat16 --config.model.attention="$attention" \
      "${TRAIN[@]}" --output="$JSONL"
  done
}

step 60 "devices and imports" python3 -c "import jax, flax, optax, orbax.checkpoint, grain, ml_collections, \
sentencepiece, sacrebleu, pytest; import transformer.trainer, transformer.decode; print(jax.__version__, \
flax.__version__, optax.__version__, jax.devices())"
JAX_DEFAULT_MATMUL_PRECISION=highest step 120 "attention implementations agree" \
  python3 -m pytest -q -p no:cacheprovider -o addopts="-m 'not slow'" "${TESTS[@]}"  # no xdist there
train base
step 150 "decode base, beam 4" python3 scripts/benchmark.py --mode=decode --config=configs/base.py \
  "${DECODE[@]}" --output="$JSONL"
step 120 "decode base, beam 4, bfloat16 weights" python3 scripts/benchmark.py --mode=decode --config=configs/base.py \
  "${DECODE[@]}" --decode_weights=bfloat16 --output="$JSONL"
MBR_BATCH=750 && [ "${GPU_CHECKS_SMOKE:-0}" = 1 ] && MBR_BATCH=2
step 120 "decode base, MBR's 16 samples per sentence" python3 scripts/benchmark.py --mode=decode \
  --config=configs/base.py "${DECODE[@]}" --batch=$MBR_BATCH --candidates=16 --output="$JSONL"
variant() {  # variant TITLE OVERRIDES...: base's training step with model overrides, bfloat16, xla attention
  local title=$1
  shift
  step 120 "train base as $title" python3 scripts/benchmark.py --mode=train --config=configs/base.py \
    --config.model.dtype=bfloat16 --config.model.attention=xla "${TRAIN[@]}" "$@" --output="$JSONL"
}
LAYERS=14 && [ "${GPU_CHECKS_SMOKE:-0}" = 1 ] && LAYERS=2
variant decoder_only --config.model.family=decoder_only --config.model.num_encoder_layers=0 \
  --config.model.num_decoder_layers=$LAYERS
variant encoder_only --config.model.family=encoder_only --config.model.num_decoder_layers=0 \
  --config.train.bleu_every_steps=0 --config.train.keep_best_checkpoint=false  # a masked LM has no BLEU
variant "8 experts top-2" --config.model.num_experts=8 --config.model.experts_per_token=2 --config.model.expert_every=2
HYBRID=--config.model.decoder_attention=ssm,ssm,dense
variant "hybrid ssm,ssm,dense" $HYBRID
step 150 "decode base hybrid, beam 4" python3 scripts/benchmark.py --mode=decode --config=configs/base.py $HYBRID \
  "${DECODE[@]}" --output="$JSONL"
step 150 "decode cost against length, ssm and dense" python3 scripts/benchmark_attention.py --parts=decode \
  --kinds=dense,ssm --config=configs/base.py --config.model.dtype=bfloat16 "${LENGTHS[@]}" --output_dir="$OUT/decode_cost"
[ "${GPU_CHECKS_SMOKE:-0}" = 1 ] || train big  # the plumbing of 'big' is the same as base's
echo "== done $(date -u +%H:%M:%S)" | tee -a "$LOG"
