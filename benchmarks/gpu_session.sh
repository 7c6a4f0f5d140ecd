#!/bin/bash
# The figures issues #31 and #32 still owe, measured in one run on one lent GPU (docs/gpu.md,
# "Measuring on your GPU"). Run from the repository root with the wheels of ../shared/GPU.md in
# .whl/ (jaxtrain + flax, optax, orbax, chex); writes tables and JSON under $OUT (default
# ./gpu-out). Sections, in this order unless named: attention step moe.
#
#   bash benchmarks/gpu_session.sh [attention] [step] [moe]
#
# attention  the Hopper (Mosaic GPU) flash kernel, our Triton kernel and cuDNN at the issue shape,
#            checked against the f32 reference, then head_dim 64/256, 16k tokens and a window
# step       the 0.886B Llama step: jaxtrain (auto, attention_impl=pallas_mosaic, and autodiff's
#            layer loop: model.compact_grads=false) vs torch.compile, each in its own process
# moe        the dropless MoE step (Triton grouped matmul) against capacity 1.25
# Each section has its own time limit, so one that hangs costs only its own minutes: attention
# 350 s, step 330 s, moe 170 s, so under a 600 s limit per command run `attention`, then
# `step moe`.
set +e
REPO=$(pwd)
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
SECTIONS=${*:-attention step moe}
if ls "$REPO"/.whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$REPO"/.whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
cd /tmp || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
T0=$(date +%s)
say() { echo "== $1 $(date +%T) +$(($(date +%s) - T0))s"; }
show() { grep -v "^WARNING\|^I0000\|^W0000\|^E0000\|^{" "$1" | tail -"$2"; }

for section in $SECTIONS; do
  case $section in
    attention)
      say attention
      timeout 200 python3 "$REPO"/benchmarks/attention.py --gpu --check --cases base \
        --impls mosaic,triton,cudnn --iters 10 --json "$OUT"/attention_base.json \
        > "$OUT"/attention_base.txt 2>&1
      show "$OUT"/attention_base.txt 8
      timeout 150 python3 "$REPO"/benchmarks/attention.py --gpu --cases dim64,dim256,seq16k,win1k-s8k \
        --impls mosaic,cudnn --iters 5 --json "$OUT"/attention_sweep.json \
        > "$OUT"/attention_sweep.txt 2>&1
      show "$OUT"/attention_sweep.txt 12
      ;;
    step)
      say step
      timeout 330 python3 "$REPO"/benchmarks/gpu_peer.py --steps 10 --only jaxtrain,torch-compile \
        --jaxtrain-variants "mosaic:model.attention_impl=pallas_mosaic;plain-grads:model.compact_grads=false" \
        --json "$OUT"/peer.json \
        > "$OUT"/peer.txt 2>&1
      show "$OUT"/peer.txt 20
      ;;
    moe)
      say moe
      timeout 170 python3 "$REPO"/benchmarks/moe.py --gpu --only step --steps 10 --impls triton \
        --json "$OUT"/moe_step.json > "$OUT"/moe_step.txt 2>&1
      show "$OUT"/moe_step.txt 12
      ;;
    *) echo "unknown section $section: expected attention, step or moe" >&2 ;;
  esac
done
say done
