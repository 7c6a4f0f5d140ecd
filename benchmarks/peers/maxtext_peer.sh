#!/usr/bin/env bash
# Runs the peer trainer (MaxText 0.2.5, from PyPI) on this machine's CPU with a tiny
# Llama-style config, so that jaxtrain's throughput can be compared side by side.
#
#   benchmarks/peers/maxtext_peer.sh [NDEV] [DTYPE] [STEPS]
#     NDEV   simulated CPU devices, all on the fsdp axis (default 8)
#     DTYPE  float32 | bfloat16 activations; weights stay float32 (default float32)
#     STEPS  training steps (default 30); the first 3 are left out of the median
#
# Model: 4 layers, d_model 256, 4 query / 4 kv heads of 64, SwiGLU mlp 1024,
# vocab 32000, untied output, RoPE theta 1e4, seq 512, global batch 8 (4096
# tokens a step), synthetic data, AdamW, grad clip 1.0, remat full, no checkpoints.
# Last line printed: "maxtext ndev=.. dtype=.. step_time_s=<median> tokens_per_second=<median>".
# The venv is cached at $PEER_VENV (default ~/.cache/jaxtrain-peer/maxtext-venv); MaxText needs
# Python >= 3.12. Nothing is written into the project.
set -euo pipefail
NDEV=${1:-8}; DTYPE=${2:-float32}; STEPS=${3:-30}
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/jaxtrain-peer
VENV=${PEER_VENV:-$CACHE/maxtext-venv}
OUT=${PEER_OUT:-$CACHE/runs}

find_python() {
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0; fi
  done
  for c in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.1[2-9]*/bin/python3; do
    [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import maxtext' 2>/dev/null; then
  PY=$(find_python) || { echo "maxtext_peer: no Python >= 3.12 found" >&2; exit 2; }
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q --no-deps -r "$HERE/maxtext-requirements.txt"
fi

MT=$("$VENV/bin/python" -c 'import maxtext, os; print(os.path.dirname(maxtext.__file__))')
mkdir -p "$OUT"
RUN=peer-$NDEV-$DTYPE-$$
LOG=$OUT/$RUN.log
PDBS=$((8 / NDEV)); [ "$PDBS" -ge 1 ] || { echo "maxtext_peer: NDEV must divide 8" >&2; exit 2; }
(
  cd "$OUT"
  export DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$NDEV"
  "$VENV/bin/python" -m maxtext.trainers.pre_train.train "$MT/configs/base.yml" \
    run_name=$RUN base_output_directory="$OUT/out" hardware=cpu skip_jax_distributed_system=True \
    dataset_type=synthetic enable_checkpointing=False steps="$STEPS" log_period=1000 \
    base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=1024 base_num_decoder_layers=4 \
    head_dim=64 vocab_size=32000 max_target_length=512 per_device_batch_size=$PDBS \
    dtype="$DTYPE" attention=dot_product ici_fsdp_parallelism="$NDEV" \
    enable_goodput_recording=False monitor_goodput=False jax_cache_dir="$OUT/jcache-$RUN"
) >"$LOG" 2>&1 || { tail -20 "$LOG" >&2; echo "maxtext_peer: run failed, log $LOG" >&2; exit 1; }

"$VENV/bin/python" - "$LOG" "$NDEV" "$DTYPE" <<'EOF'
import re, statistics, sys
log, ndev, dtype = sys.argv[1:4]
steps = [float(m.group(1)) for m in re.finditer(r"completed step: \d+, seconds: ([\d.]+)", open(log).read())]
if len(steps) < 5:
    sys.exit(f"maxtext_peer: too few steps logged in {log}")
t = statistics.median(steps[3:])
print(f"maxtext ndev={ndev} dtype={dtype} step_time_s={t:.3f} tokens_per_second={4096 / t:.0f}")
EOF
