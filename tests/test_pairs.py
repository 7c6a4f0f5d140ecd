"""Pairwise checks as a covering array (issue #62, item 3): each row of jaxtrain/compose.py's
PAIR_ROWS switches on many compatible features at once, on a mesh, and must give the numbers of
its oracle: the same config on ONE device with every *transparent* feature switched off (the
mesh axes and pipeline schedules, sequence parallelism, remat, offload, ZeRO-1 and the chunked
loss: compose.TRANSPARENT, which must not change a run's numbers). So one row tests every pair
(transparent feature, any feature of the row); pairs of two non-transparent features (the same
on both sides) are not claimed. compose.row_pairs says which pairs a row covers, and the table
cites the row for each of them that no other test covers.

Each run is a tiny model (4 layers, d_model 32, seq 16, vocab 128, 8 rows) for two optimizer
steps (program.step, as the loop runs it) from the seed's weights. Each axis of a row is 2; a
pipeline is mesh.stage=2 with 2 microbatches (circular and interleaved: 2 repeats). MoE takes its
batch in train.microbatches=2 (the router losses are means over microbatches, as a pipeline's
microbatches take them): on a pipeline row the mesh side takes them as pipeline microbatches.
Context runs see the batch in zig-zag order, as the loop feeds it.

Tolerances (float32 on both sides: the mesh changes the order of f32 sums only): losses and
gradient norms of both steps rtol 1e-5, every trained parameter's move rtol 2e-4 / atol 1e-6
(tests/test_sharded_training.py's). Where 16-bit numbers are on both sides (bf16 / fp16 compute,
bf16 optimizer state) a different order of sums can round a value to the next 16-bit number:
LOW_* below, stated with what was measured.

The move is a gradient's measure: Adam runs with eps=1 and lr=1, so each update is close to
the (clipped) gradient itself, and an error in a gradient is not amplified (with eps=1e-8 a
gradient of 1e-9 on one device and 0 on the mesh would differ by a whole lr step), nor lost
in the rounding of the weights."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pytest

from jaxtrain import compose, sharding
from jaxtrain.config import validate
from jaxtrain.data.core import batch_from_windows
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.sharding.context import permute_batch
from jaxtrain.trainer import grpo
from jaxtrain.trainer.program import build_program
from tests.conftest import REPO, tiny_config

# f32: the mesh changes the order of sums only (tests/test_sharded_training.py)
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-6
# 16-bit compute or optimizer state on both sides: losses and grad norms relative; each tensor's
# move by the relative Frobenius norm of its difference (a 16-bit rounding flip, or an expert
# choice it tips, moves a few elements far). Measured: step-1 losses within 2e-5, step-2 grad
# norms within 2.8e-3 (lm-zb-tp: fp16 compute, Muon), moves within 6.6e-2 (lm-fsdp-cp-ep, bf16
# and fp8: the norm scales, whose gradients sum many small terms); a gradient that misses its
# reduction over a mesh axis of 2 is off by 50% or more
LOW_LOSS_RTOL, LOW_MOVE_TOL = 5e-3, 0.1
# Muon: Newton-Schulz amplifies the f32 rounding of a gradient along its small singular directions
# (qk_norm leaves wk's gradient one: the norm is blind to a row's scale); measured up to 2.5e-5 of
# a tensor's largest move (1e-5 absolute at lr=1; tests/test_muon.py's mesh check: atol 1e-5)
MUON_MOVE_TOL = 1e-4
ROWS, SEQ, VOCAB = 8, 16, 128
CHATML = f"{REPO}/tests/assets/chat/chatml"

BASE = (
    "model.vocab_size=128",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.mlp_dim=64",
    "model.n_layers=4",
    "train.seq_len=16",
    f"train.global_batch_size={ROWS}",
    "train.steps=2",
    "train.loss_chunk=0",
    "optimizer.warmup_steps=0",
    "optimizer.lr=1.0",
    "optimizer.eps=1.0",
)

_PIPE = ("mesh.stage=2", "pipeline.microbatches=2")
# each feature's overrides (over BASE); lm, dense and adamw are the defaults
OVERRIDES: dict[str, tuple[str, ...]] = {
    "lm": (),
    "chat": ("data.source=tokens", "data.paths=[unused]"),
    "dpo": ("train.objective=dpo", "data.source=tokens", "data.paths=[unused]", "dpo.beta=0.5"),
    "grpo": (
        "train.objective=grpo",
        "data.source=prompts",
        "data.paths=[unused]",
        f"data.tokenizer={CHATML}",
        "grpo.rewards=[unused:reward]",
        "grpo.group_size=2",
        "grpo.max_new_tokens=8",
        "grpo.beta=0.1",
    ),
    "dense": (),
    "moe": ("model.moe={num_experts: 4, top_k: 2, expert_mlp_dim: 32}", "train.microbatches=2"),
    "mla": (
        "model.n_kv_heads=4",
        "model.mla={kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8}",
    ),
    "mtp": ("model.mtp={depth: 1}",),
    "sinks": ("model.attention_sinks=true",),
    "attention_pattern": ("model.attention_pattern=[local,global]", "model.sliding_window=6"),
    "qk_norm": ("model.qk_norm=head",),
    "final_softcap": ("model.final_softcap=2.0",),  # small enough to bend the tiny model's logits
    "linear_attention": (
        "model.layer_types=[linear_attention, full_attention]",
        "model.linear_attention={num_key_heads: 2, num_value_heads: 4, key_head_dim: 8, value_head_dim: 8}",
    ),
    "lora": ("model.lora={rank: 4, alpha: 8}",),
    "bf16": ("model.compute_dtype=bfloat16",),
    "fp16": ("model.compute_dtype=float16",),
    "fp8": ("model.fp8=true", "model.fp8_amax_history=4"),
    "state_16bit": ("optimizer.state_dtype=bfloat16",),
    "adamw": (),
    "muon": ("optimizer.name=muon",),
    "qk_clip": ("optimizer.qk_clip.tau=2.0",),  # low enough that the lr=1 steps clip
    # transparent: off on the oracle's side
    "data": ("mesh.data=2",),
    "fsdp": ("mesh.fsdp=2",),
    "tensor": ("mesh.tensor=2",),
    "sequence_parallel": ("mesh.rules=fsdp_tensor_sp",),
    "expert": ("mesh.expert=2",),
    "context": ("mesh.context=2",),
    "gpipe": (*_PIPE, "pipeline.schedule=gpipe"),
    "circular": (*_PIPE, "pipeline.schedule=circular", "pipeline.repeats=2"),
    "1f1b": (*_PIPE, "pipeline.schedule=1f1b"),
    "interleaved_1f1b": (*_PIPE, "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2"),
    "zero_bubble": (*_PIPE, "pipeline.schedule=zero_bubble"),
    "remat": ("model.remat=full",),
    "offload": ("optimizer.offload=true", "optimizer.offload_params=true"),
    "zero1": ("optimizer.shard_state=true",),
    "chunked_loss": ("train.loss_chunk=8",),
}
# the sampler reads the weights on the device (trainer/rollout.py): GRPO offloads the moments only
GRPO_OFFLOAD = ("optimizer.offload=true",)
LOW_PRECISION = {"bf16", "fp16", "fp8", "state_16bit"}


def overrides(features: tuple[str, ...], oracle: bool = False) -> tuple[str, ...]:
    """The row's overrides; `oracle`: its one-device reference (the transparent features off)."""
    kept = [f for f in features if not (oracle and f in compose.TRANSPARENT)]
    out = [o for f in kept for o in (GRPO_OFFLOAD if f == "offload" and "grpo" in features else OVERRIDES[f])]
    if not oracle and "moe" in features and any(f in compose.SCHEDULES for f in features):
        out.append("train.microbatches=1")  # the pipeline's 2 microbatches take MoE's 2
    return (*BASE, *out)


def config(features: tuple[str, ...], oracle: bool = False):
    return tiny_config(None, *overrides(features, oracle))


# --- the batches: two per objective, fixed by a seed ------------------------------------------


def _lm_rows(rng) -> dict:
    tokens = rng.integers(0, VOCAB, size=(ROWS, SEQ + 1))
    return batch_from_windows(tokens, np.ones_like(tokens))


def _chat_rows(rng) -> dict:
    """Packed rows as chat data has them: two documents and padding per row, the loss on
    assistant spans only."""
    tokens = rng.integers(0, VOCAB, size=(ROWS, SEQ + 1))
    docs, mask = np.zeros_like(tokens), np.zeros_like(tokens)
    for r in range(ROWS):
        first, end = rng.integers(4, 9), rng.integers(13, SEQ + 2)
        docs[r, :first], docs[r, first:end] = 1, 2
        mask[r, 2:first], mask[r, first + 2 : end] = 1, 1
    return batch_from_windows(tokens, docs, mask)


def _dpo_rows(rng) -> dict:
    from tests.test_dpo import _random_pairs

    return _random_pairs(rng, ROWS, SEQ, VOCAB)


def _grpo_rows(rng) -> dict:
    """A rollout batch (trainer/rollout.py's fields): prompts of 4 to 7 tokens, completions to the
    row's end or shorter; old log-probs near the initial policy's (about -ln 128), so that most
    ratios are inside the clip range and some outside."""
    tokens = rng.integers(0, VOCAB, size=(ROWS, SEQ + 1))
    docs, completion = np.zeros_like(tokens), np.zeros_like(tokens)
    for r in range(ROWS):
        prompt, end = rng.integers(4, 8), rng.integers(SEQ - 4, SEQ + 2)
        docs[r, :end], completion[r, prompt:end] = 1, 1
    rows = batch_from_windows(tokens, docs, completion)
    weight, share = grpo.loss_weights(rows["loss_mask"], "dapo", 8)
    adv = grpo.advantages(rng.normal(size=ROWS), 2, "group")
    old = (-math.log(VOCAB) + rng.normal(scale=0.15, size=(ROWS, SEQ))) * rows["loss_mask"]
    rows.update(
        advantages=np.repeat(adv[:, None], SEQ, axis=1).astype(np.float32),
        old_logps=old.astype(np.float32),
        loss_weight=weight,
        token_share=share,
    )
    return rows


_BATCHES = {"dpo": _dpo_rows, "grpo": _grpo_rows, "chat": _chat_rows}


def batches(features: tuple[str, ...]) -> list[dict]:
    rng = np.random.default_rng(0)
    make = next((_BATCHES[f] for f in features if f in _BATCHES), _lm_rows)
    return [make(rng) for _ in range(2)]


# --- one run: two steps on a mesh -------------------------------------------------------------


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


@functools.cache
def two_steps(overrides: tuple[str, ...], objective: tuple[str, ...]) -> dict:
    """Both steps' losses and gradient norms, and how far the two updates moved each trained
    parameter (program.step: the train step the loop runs). Cached: rows share oracles."""
    cfg = tiny_config(None, *overrides)
    n = math.prod(cfg.mesh.sizes().values())
    validate(cfg, n)
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:n])
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    out = {"loss": [], "grad_norm": []}
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        state = program.init()
        start = _flat(jax.device_get(state.params))
        for r in batches(objective):  # in zig-zag order over a context axis, as the loop feeds it
            r = permute_batch(r, cfg.mesh.context, axis=r["inputs"].ndim - 1)
            state, metrics = program.step(
                state, {k: jax.device_put(v, program.batch_sharding) for k, v in r.items()}
            )
            out["loss"].append(float(metrics["loss"]))
            out["grad_norm"].append(float(metrics["grad_norm"]))
        out["moved"] = {k: v - start[k] for k, v in _flat(jax.device_get(state.params)).items()}
    return out


def run(features: tuple[str, ...], oracle: bool = False) -> dict:
    objective = tuple(f for f in features if f in _BATCHES)
    return two_steps(overrides(features, oracle), objective)


def assert_same(got: dict, want: dict, low: bool, muon: bool = False) -> None:
    loss_rtol = LOW_LOSS_RTOL if low else LOSS_RTOL
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=loss_rtol, err_msg=key)
    assert got["moved"].keys() == want["moved"].keys()
    for path, a in got["moved"].items():
        b = want["moved"][path]
        if low:
            error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-9)
            assert error <= LOW_MOVE_TOL, (path, error)
        elif muon:
            np.testing.assert_allclose(
                a, b, rtol=0, atol=MUON_MOVE_TOL * np.abs(b).max() + GRAD_ATOL, err_msg=path
            )
        else:
            np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=path)


# --- the rows -----------------------------------------------------------------------------------

XFAIL: dict[str, str] = {}  # row id -> the defect that makes it differ (strict)


def _param(row: str):
    pairs = [f"{a}+{b}" for a, b in compose.row_pairs(compose.PAIR_ROWS[row])]
    marks = [pytest.mark.composes(*pairs)]
    if row in XFAIL:
        marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[row]))
    return pytest.param(row, id=row, marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in compose.PAIR_ROWS])
def test_row_equals_one_device(row):
    features = compose.PAIR_ROWS[row]
    low = bool(LOW_PRECISION & set(features))
    assert_same(run(features), run(features, oracle=True), low=low, muon="muon" in features)


def test_each_row_switches_on_exactly_its_features():
    """A row's config is accepted on its mesh, and switches on what the row says (the table's
    predicates; chat's predicate reads a data manifest, which these rows have not) and nothing
    else; its oracle switches on no transparent feature. No compiles."""
    for row, features in compose.PAIR_ROWS.items():
        cfg = config(features)
        validate(cfg, math.prod(cfg.mesh.sizes().values()))
        want = {"lm" if f == "chat" else f for f in features}
        assert set(compose.active(cfg)) == want, row
        assert not set(compose.active(config(features, oracle=True))) & set(compose.TRANSPARENT), row


def test_every_accepted_pair_with_a_transparent_feature_is_tested():
    """Every pair that holds a transparent feature or multiprocess, and that the table does not
    refuse, names a test (a row here, a row of tests/test_multiprocess_rows.py, or a test of its
    own); the rows are distinct and list each feature once."""
    untested = [
        p
        for p in compose.all_pairs()
        if set(p) & {*compose.TRANSPARENT, "multiprocess"}
        and isinstance(compose.status(*p), compose.Untested)
    ]
    assert not untested, untested
    for rows in (compose.PAIR_ROWS, compose.PROCESS_ROWS):
        assert all(len(set(f)) == len(f) for f in rows.values())
