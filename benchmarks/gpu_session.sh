#!/bin/bash
# The GPU figures, measured in one run on one lent GPU (docs/gpu.md, "Measuring on your GPU").
# Run from the repository root with the wheels of docs/gpu.md in .whl/ (jaxtrain + flax, optax,
# orbax, chex, liger-kernel, torchtitan and its pure-Python dependencies, and .whl/REVISION);
# writes logs and JSON under $OUT (default ./gpu-out) and every script's result file under
# $OUT/results/<script>/ (copy them into benchmarks/results/ and run benchmarks/report.py).
# Sections, in this order unless named: attention step moe sweep.
#
#   bash benchmarks/gpu_session.sh [attention] [step] [moe] [sweep] [peer]
#
# attention  the Hopper (Mosaic GPU) flash kernel, our Triton kernel and cuDNN at the issue shape,
#            checked against the f32 reference: the whole output and gradients of the very calls
#            then timed, all 4 batch rows and 32 heads (attention_gpu.check_errors)
# step       the 0.886B Llama step: jaxtrain (auto; remat none; attention_impl=pallas_mosaic once
#            `attention` has seen that kernel correct here) against the whole torch step compiled,
#            SDPA pinned to cuDNN and to FlashAttention-2; 3 repeats of 20 timed steps each
# peer       (not run unless named) torch's other best settings at the same shape: Liger's fused
#            linear cross-entropy, max-autotune, torchtitan's Llama 3, and remat full on both
#            sides for memory at the same policy; 400 s
# moe        the dropless MoE step (Triton grouped matmul, remat auto, then remat none) against
#            capacity 1.25
# sweep      the Mosaic kernel against cuDNN at head_dim 256, its dK/dV kernel split in two or not
# tiles      (not run unless named) the Triton grouped matmul of dropless MoE with other tiles,
#            warps and stages than its defaults (GroupedMatmulBlocks), at the MoE layer's shapes;
#            200 s, so `step moe tiles` fits one 600 s command too
# gmm        (not run unless named) the Triton grouped matmul alone at the MoE layer's shapes, 120 s
# long       (not run unless named) the Mosaic kernel against cuDNN at 32k and 8k tokens, 80 s
# Each section has its own time limit, so one that hangs costs only its own minutes: attention
# 110 s, step 280 s, moe 150 s, sweep 80 s: 620 s in all, so run `attention step` and `moe sweep`
# as two commands on a lent GPU, and `peer` as a third.
set +e
REPO=$(pwd)
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
export JAXTRAIN_RESULTS_DIR="$OUT/results"
SECTIONS=${*:-attention step moe sweep}
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

# exit 0 when the JSON rows in $1 hold a Mosaic row within the reference's tolerance (every error
# present: a row without the check fails)
mosaic_correct() {
  python3 - "$1" 2> /dev/null << 'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
errs = ("err_out", "err_dq", "err_dk", "err_dv")
ok = [r for r in rows if r["impl"] == "mosaic" and "error" not in r and max(r.get(k, 1.0) for k in errs) < 1e-2]
sys.exit(0 if ok else 1)
PY
}

for section in $SECTIONS; do
  case $section in
    attention)
      say attention
      timeout 110 python3 "$REPO"/benchmarks/attention.py --gpu --check --cases base \
        --impls mosaic,triton,cudnn --iters 10 --json "$OUT"/attention_base.json \
        > "$OUT"/attention_base.txt 2>&1
      show "$OUT"/attention_base.txt 8
      ;;
    step)
      say step
      VARIANTS="remat-none:model.remat=none"
      if mosaic_correct "$OUT"/attention_base.json; then
        VARIANTS="$VARIANTS;mosaic:model.attention_impl=pallas_mosaic"
      fi
      timeout 280 python3 "$REPO"/benchmarks/gpu_peer.py --steps 20 --repeats 3 \
        --only jaxtrain,torch-compile --jaxtrain-variants "$VARIANTS" --torch-attention cudnn \
        --torch-variants "sdpa-flash:attention=flash" --json "$OUT"/peer.json > "$OUT"/peer.txt 2>&1
      show "$OUT"/peer.txt 24
      ;;
    peer)
      say peer
      timeout 400 python3 "$REPO"/benchmarks/gpu_peer.py --steps 20 --repeats 3 \
        --only jaxtrain,torch-compile,torchtitan --no-auto --jaxtrain-variants "full:model.remat=full" \
        --torch-attention cudnn --torch-loss liger \
        --torch-variants "max-autotune:mode=max-autotune;full:remat=full" \
        --json "$OUT"/peer_best.json > "$OUT"/peer_best.txt 2>&1
      show "$OUT"/peer_best.txt 24
      ;;
    moe)
      say moe
      timeout 150 python3 "$REPO"/benchmarks/moe.py --gpu --only step --steps 10 --impls triton \
        --variants "remat-none:model.remat=none" --json "$OUT"/moe_step.json > "$OUT"/moe_step.txt 2>&1
      show "$OUT"/moe_step.txt 12
      ;;
    sweep)
      say sweep
      # head_dim 64, 16k tokens and a window were measured on 2026-11-27 (docs/benchmarks.md);
      # run `attention.py --gpu --cases dim64,seq16k,win1k-s8k --impls mosaic,cudnn` for them.
      # head_dim 256: the dK/dV kernel in two head-dim parts (the default) against one (before)
      timeout 80 python3 "$REPO"/benchmarks/attention.py --gpu --check --cases dim256 \
        --impls mosaic,mosaic+dkv_parts=1,cudnn --iters 5 --json "$OUT"/attention_d256.json \
        > "$OUT"/attention_d256.txt 2>&1
      show "$OUT"/attention_d256.txt 8
      ;;
    tiles)
      say tiles
      # tiles that divide the MoE layer's 1408 (a multiple of 128, not 256), so no padding copies;
      # block_k=32 with 4 stages and 4 warps is Triton's H100 matmul tutorial's first config
      TILES="triton,triton+num_stages=4,triton+num_warps=4,triton+block_k=32+num_stages=4+num_warps=4"
      TILES="$TILES,triton+block_m=64,triton+block_k=128+num_stages=2,triton+tgmm_m=128"
      TILES="$TILES,triton+num_stages=4+tgmm_m=128"
      timeout 200 python3 "$REPO"/benchmarks/moe.py --gpu --only matmul --impls "$TILES" --iters 10 \
        --json "$OUT"/moe_tiles.json > "$OUT"/moe_tiles.txt 2>&1
      show "$OUT"/moe_tiles.txt 40
      ;;
    gmm)
      say gmm
      timeout 120 python3 "$REPO"/benchmarks/moe.py --gpu --only matmul --impls triton --iters 10 \
        --json "$OUT"/moe_matmul.json > "$OUT"/moe_matmul.txt 2>&1
      show "$OUT"/moe_matmul.txt 12
      ;;
    long)
      say long
      # the long end of the issue's 2k-32k sweep: one row of 32k tokens, and B2 S8192
      timeout 80 python3 "$REPO"/benchmarks/attention.py --gpu --check --cases seq32k,seq8k \
        --impls mosaic,cudnn --iters 5 --json "$OUT"/attention_long.json \
        > "$OUT"/attention_long.txt 2>&1
      show "$OUT"/attention_long.txt 8
      ;;
    *) echo "unknown section $section: expected attention, step, moe, sweep, peer, tiles, gmm or long" >&2 ;;
  esac
done
say done
