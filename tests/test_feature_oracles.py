"""Pairs of two non-transparent features (issue #62): objectives, model features, optimizers and
16-bit numbers, checked row by row on ONE device against oracles that do not come from the pairs
they claim. A row switches on a set of compatible features (a tiny model, configs/tiny.yaml
shrunk) and is compiled once; tests/test_pairs.py covers the pairs with a transparent feature.

Float32 rows, `test_objective_and_update_equal_plain_oracles`:

1. the objective: the program's loss and gradients (`program.loss_and_grads`, the step's own
   `batch_gradients`) equal a plain recomputation written here from the model's final-normed
   hidden states: logits = h @ lm_head, the final softcap c tanh(z / c) by hand, the objective's
   formula (lm / chat: the mean token cross-entropy over the loss mask; DPO: TRL's sigmoid loss,
   mean over the pairs; GRPO: TRL's clipped ratio loss with dapo weights), the router losses
   with their weights (for DPO and LM over the mean loss, for GRPO beside it, TRL's rule) and the
   multi-token prediction loss (DeepSeek-V3: the mean over depths of each module's mean
   cross-entropy, targets written per position here, the modules' router losses averaged with
   the main layers'), differentiated by jax.grad;
2. the update: one `program.step` moves every trained parameter by a hand-written numpy AdamW
   or Muon step (clip by global norm, then AdamW with eps and decoupled weight decay on the
   matmul weights only, or Muon on the hidden matrices: momentum, Nesterov, Newton-Schulz in
   float64 as tests/test_muon.py transcribes torch, Moonshot's lr adjustment) applied to the
   program's own gradients, each parameter's role (Muon or AdamW, decay or not, its matrix
   shape) written here by its name, not read from its logical axes.

So a row checks objective x model feature, optimizer x model feature and objective x optimizer.

16-bit rows, `test_low_precision_tracks_float32`: a float32 row with bf16 / fp16 compute, fp8
matmuls and / or bfloat16 optimizer state switched on; two steps give losses, gradient norms and
parameter moves within a stated tolerance of the float32 row's own two steps, and finite.

Optimizer settings: lr 1 (no warmup), Adam eps 1, so an update is close to the clipped gradient
itself and errors in a gradient are not lost in the weights' rounding (tests/test_pairs.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import compose, models, sharding
from jaxtrain.config import validate
from jaxtrain.models import lora
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.trainer.program import build_program
from tests.conftest import tiny_config
from tests.test_muon import newton_schulz_np
from tests.test_pairs import OVERRIDES as PAIR_OVERRIDES

ROWS_N, SEQ, VOCAB = 8, 16, 128

# float32, another op order than the program's: losses rtol 1e-5, gradients as
# tests/test_mtp.py and tests/test_sharded_training.py (rtol 2e-4, atol 1e-6)
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-6
# an update: numpy float64 against the program's float32 (Newton-Schulz: tests/test_muon.py 2e-6
# on unit-norm matrices; here moves of order lr = 1)
MOVE_ATOL = 2e-5
# 16-bit against float32, the first step (tests/test_model.py: bf16 logits within 2e-2 of the
# logit scale; tests/test_precision.py: losses within 1%): the loss against max(|loss|, 1), the
# gradient norm relative, each parameter's move in relative Frobenius norm. Moves are loose where
# measured so: Muon orthogonalises a bf16 gradient (`wo`: 0.15 in bf16), and DPO's gradient at
# the reference point is a difference of two sequences' (cancellation: 0.26 in bf16 + fp8); a
# parameter left untrained or moved the wrong way is 1 or 2. Measured: losses <= 1.1e-4, gradient
# norms <= 1.1e-3, fp16 + bf16 state moves <= 2.2e-3.
# bf16 / fp8 moves: up to 0.37 measured on the norm scales of grpo-moe-pattern-qknorm-adamw (each
# scale's gradient sums many per-token terms of both signs; GRPO's are small differences)
LOW_TOL = {
    "bf16": dict(loss=1e-2, grad_norm=5e-2, move=0.4),
    "fp16": dict(loss=1e-2, grad_norm=5e-2, move=5e-2),
    "fp8": dict(loss=1e-2, grad_norm=5e-2, move=0.4),
    "state_16bit": dict(loss=1e-3, grad_norm=1e-3, move=1e-2),  # compensated bf16 state
}

BASE = (
    "model.vocab_size=128",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.mlp_dim=64",
    "model.n_layers=2",
    "train.seq_len=16",
    f"train.global_batch_size={ROWS_N}",
    "train.steps=2",
    "train.loss_chunk=0",
    "optimizer.warmup_steps=0",
    "optimizer.lr=1.0",
    "optimizer.eps=1.0",
)
# each feature's overrides: tests/test_pairs.py's, but for MoE (one microbatch here: the oracle
# recomputes one batch's router losses) and MTP (a loss weight other than 1 to check it)
OVERRIDES: dict[str, tuple[str, ...]] = {
    **{f: PAIR_OVERRIDES[f] for f in (
        "lm", "chat", "dpo", "grpo", "mla", "sinks", "attention_pattern", "qk_norm", "final_softcap",
        "linear_attention", "lora", "adamw", "muon", "bf16", "fp16", "fp8", "state_16bit",
    )},
    "moe": ("model.moe={num_experts: 4, top_k: 2, expert_mlp_dim: 32}",),
    "mtp": ("model.mtp={depth: 1, loss_weight: 0.3}",),
}  # fmt: skip
OBJECTIVES = ("lm", "chat", "dpo", "grpo")
MODEL = (
    "moe", "mla", "mtp", "sinks", "attention_pattern", "qk_norm", "final_softcap", "linear_attention", "lora",
)  # fmt: skip
OPTIMIZERS = ("adamw", "muon")
LOW = ("bf16", "fp16", "fp8", "state_16bit")

# float32 rows: an objective, model features and an optimizer, chosen to cover the untested
# pairs of compose.py among them in few compiles
ROWS: dict[str, tuple[str, ...]] = {
    "lm-moe-mla-mtp-sinks-softcap-muon": ("lm", "moe", "mla", "mtp", "sinks", "final_softcap", "muon"),
    "chat-mla-mtp-sinks-softcap-adamw": ("chat", "mla", "mtp", "sinks", "final_softcap", "adamw"),
    "chat-moe-sinks-pattern-qknorm-softcap-lora-muon": (
        "chat", "moe", "sinks", "attention_pattern", "qk_norm", "final_softcap", "lora", "muon",
    ),
    "dpo-moe-sinks-pattern-qknorm-softcap-adamw": (
        "dpo", "moe", "sinks", "attention_pattern", "qk_norm", "final_softcap", "adamw",
    ),
    "dpo-mla-muon": ("dpo", "mla", "muon"),
    "grpo-mla-sinks-softcap-muon": ("grpo", "mla", "sinks", "final_softcap", "muon"),
    "grpo-moe-pattern-qknorm-adamw": ("grpo", "moe", "attention_pattern", "qk_norm", "adamw"),
    # gated DeltaNet layers (model.layer_types: one linear, one full attention layer)
    "chat-linear-sinks-softcap-muon": ("chat", "linear_attention", "sinks", "final_softcap", "muon"),
    "dpo-linear-qknorm-adamw": ("dpo", "linear_attention", "qk_norm", "adamw"),
    "grpo-linear-sinks-muon": ("grpo", "linear_attention", "sinks", "muon"),
}  # fmt: skip
# 16-bit rows: (the float32 row, the 16-bit features switched on over it)
_A, _C = "lm-moe-mla-mtp-sinks-softcap-muon", "chat-moe-sinks-pattern-qknorm-softcap-lora-muon"
_D, _F = "dpo-moe-sinks-pattern-qknorm-softcap-adamw", "grpo-mla-sinks-softcap-muon"
_G = "grpo-moe-pattern-qknorm-adamw"
_L, _M = "chat-linear-sinks-softcap-muon", "dpo-linear-qknorm-adamw"
LOW_ROWS: dict[str, tuple[str, tuple[str, ...]]] = {
    f"{_A}+bf16+state16": (_A, ("bf16", "state_16bit")),
    f"{_C}+bf16+fp8+state16": (_C, ("bf16", "fp8", "state_16bit")),
    f"{_D}+fp16+state16": (_D, ("fp16", "state_16bit")),
    f"{_A}+fp16": (_A, ("fp16",)),
    f"{_C}+fp16": (_C, ("fp16",)),
    f"{_D}+bf16+fp8": (_D, ("bf16", "fp8")),
    f"{_G}+bf16+fp8": (_G, ("bf16", "fp8")),
    f"{_G}+fp16+state16": (_G, ("fp16", "state_16bit")),
    f"{_L}+bf16+state16": (_L, ("bf16", "state_16bit")),
    f"{_M}+fp16": (_M, ("fp16",)),
}


def overrides(features) -> tuple[str, ...]:
    return (*BASE, *(o for f in features for o in OVERRIDES[f]))


# --- the batches ------------------------------------------------------------------------------


def _window(tokens, docs, mask) -> dict:
    """[rows, seq + 1] tokens, document ids and loss mask -> the step's fields."""
    seg = docs[:, :-1].astype(np.int32)
    positions = np.zeros_like(seg)
    for r in range(seg.shape[0]):
        for t in range(seg.shape[1]):
            positions[r, t] = 0 if t == 0 or seg[r, t] != seg[r, t - 1] else positions[r, t - 1] + 1
    same = (docs[:, 1:] == docs[:, :-1]) & (docs[:, 1:] > 0)
    return dict(
        inputs=tokens[:, :-1].astype(np.int32),
        targets=tokens[:, 1:].astype(np.int32),
        positions=positions,
        segment_ids=seg,
        loss_mask=(mask[:, 1:] * same).astype(np.float32),
    )


def _lm(rng) -> dict:
    tokens = rng.integers(0, VOCAB, size=(ROWS_N, SEQ + 1))
    return _window(tokens, np.ones_like(tokens), np.ones_like(tokens))


def _chat(rng) -> dict:
    """Two documents and padding per row, the loss on assistant spans only."""
    tokens = rng.integers(0, VOCAB, size=(ROWS_N, SEQ + 1))
    docs, mask = np.zeros_like(tokens), np.zeros_like(tokens)
    for r in range(ROWS_N):
        first, end = rng.integers(4, 9), rng.integers(13, SEQ + 2)
        docs[r, :first], docs[r, first:end] = 1, 2
        mask[r, 2:first], mask[r, first + 2 : end] = 1, 1
    return _window(tokens, docs, mask)


def _dpo(rng) -> dict:
    """[pairs, 2, seq]: a shared prompt, two responses of random lengths, padding after them."""
    rows = []
    for _ in range(ROWS_N):
        prompt = rng.integers(2, SEQ // 2)
        tokens = rng.integers(0, VOCAB, size=(2, SEQ + 1))
        tokens[1, :prompt] = tokens[0, :prompt]
        docs, mask = np.zeros_like(tokens), np.zeros_like(tokens)
        for which in range(2):
            end = rng.integers(prompt + 2, SEQ + 2)
            docs[which, :end], mask[which, prompt:end] = 1, 1
        rows.append(_window(tokens, docs, mask))
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _grpo(rng) -> dict:
    """A rollout batch: prompts of 4 to 7 tokens, completions to the row's end or shorter, old
    log-probs near the initial policy's (some ratios outside the clip range), advantages of
    groups of 2, dapo weights (each completion token 1 / the batch's completion tokens)."""
    tokens = rng.integers(0, VOCAB, size=(ROWS_N, SEQ + 1))
    docs, completion = np.zeros_like(tokens), np.zeros_like(tokens)
    for r in range(ROWS_N):
        prompt, end = rng.integers(4, 8), rng.integers(SEQ - 4, SEQ + 2)
        docs[r, :end], completion[r, prompt:end] = 1, 1
    rows = _window(tokens, docs, completion)
    mask = rows["loss_mask"]
    rewards = rng.normal(size=(ROWS_N // 2, 2))
    adv = (
        (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-4)
    ).ravel()
    old = (-math.log(VOCAB) + rng.normal(scale=0.15, size=(ROWS_N, SEQ))) * mask
    rows.update(
        advantages=np.repeat(adv[:, None], SEQ, axis=1).astype(np.float32),
        old_logps=old.astype(np.float32),
        loss_weight=(mask / mask.sum()).astype(np.float32),
        token_share=(mask / mask.sum()).astype(np.float32),
    )
    return rows


_BATCHES = {"lm": _lm, "chat": _chat, "dpo": _dpo, "grpo": _grpo}


def objective_of(features) -> str:
    return next(f for f in features if f in OBJECTIVES)


def batches(features) -> list[dict]:
    rng = np.random.default_rng(0)
    return [_BATCHES[objective_of(features)](rng) for _ in range(2)]


# --- one row: the program, its gradients and two steps ------------------------------------------


def _whole(state) -> dict:
    return state.params if state.frozen is None else lora.join(state.frozen, state.params)


@functools.cache
def run(features: tuple[str, ...], oracles: bool) -> dict:
    """The row's program on one device: two steps (losses, gradient norms, each trained
    parameter's moves); with `oracles`, also the parameters before the first step, the loss and
    gradients `program.loss_and_grads` gives there on the first batch, and the plain
    recomputation's (`plain_objective`)."""
    cfg = tiny_config(None, *overrides(features))
    validate(cfg, 1)
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:1])
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    out = {"loss": [], "grad_norm": [], "cfg": cfg}
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        state = program.init()
        data = [
            {k: jax.device_put(v, program.batch_sharding) for k, v in b.items()} for b in batches(features)
        ]
        start = jax.device_get(state.params)
        if oracles:
            whole = _whole(state)
            loss, _, grads = program.loss_and_grads(whole, data[0])
            out.update(
                params=start,
                frozen=jax.device_get(state.frozen),
                loss_and_grads=(float(loss), jax.device_get(grads)),
            )
            plain = jax.jit(
                jax.value_and_grad(functools.partial(plain_objective, program, cfg), has_aux=True)
            )
            (_, ref_loss), ref_grads = plain(state.params, state.frozen, data[0])
            out["plain"] = (float(ref_loss), jax.device_get(ref_grads))
        moves = []
        for batch in data:
            state, metrics = program.step(state, batch)
            out["loss"].append(float(metrics["loss"]))
            out["grad_norm"].append(float(metrics["grad_norm"]))
            moves.append(
                jax.tree.map(
                    lambda new, old: np.asarray(new, np.float64) - old, jax.device_get(state.params), start
                )
            )
        out["moves"] = moves
    return out


# --- the plain recomputation (oracle 1) ---------------------------------------------------------


def _logits(h, params, cfg):
    """The head by hand: h @ lm_head in float32, then the final softcap c tanh(z / c)."""
    z = jnp.einsum("bsd,dv->bsv", h.astype(jnp.float32), params["lm_head"].astype(jnp.float32))
    cap = cfg.model.final_softcap
    return z if cap is None else cap * jnp.tanh(z / cap)


def _token_logps(logits, targets):
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


def _mean_ce(logits, targets, mask):
    return -jnp.sum(_token_logps(logits, targets) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _lookahead(batch, k):
    """Module k's targets and mask, per position: at t the target t + k + 1 (the batch's target
    at t + k), counted where the main loss counts target t + k and t + k is in t's document."""
    targets, mask, seg = (batch[f] for f in ("targets", "loss_mask", "segment_ids"))
    s = targets.shape[1]
    tgt = jnp.zeros_like(targets).at[:, : s - k].set(targets[:, k:])
    m = jnp.zeros(mask.shape, jnp.float32).at[:, : s - k].set(mask[:, k:] * (seg[:, k:] == seg[:, : s - k]))
    return tgt, m


def plain_objective(program, cfg, params, frozen, batch):
    """(what the step should differentiate, the loss it should report) for `params` (the
    adapters with model.lora, joined to `frozen`) on `batch`, from the model's hidden states."""
    whole = params if frozen is None else lora.join(frozen, params)
    model = models.merge(program.graphdef, program.abstract_params, whole)
    mcfg, objective = cfg.model, cfg.train.objective
    rows = batch
    if objective == "dpo":
        rows = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}
    seg = None if cfg.data.source == "synthetic" else rows["segment_ids"]
    residual, aux = model.hidden(rows["inputs"], positions=rows["positions"], segment_ids=seg, normed=False)
    logits = _logits(model.final_norm(residual), whole, cfg)
    mask = rows["loss_mask"]
    if objective == "dpo":
        logps = jnp.sum(_token_logps(logits, rows["targets"]) * mask, axis=-1).reshape(-1, 2)
        ratios = logps - jax.lax.stop_gradient(logps)  # the reference is the initial policy
        z = cfg.dpo.beta * (ratios[:, 0] - ratios[:, 1])
        counted = jnp.all(jnp.sum(batch["loss_mask"], axis=-1) > 0, axis=-1).astype(jnp.float32)
        loss = jnp.sum(counted * -jax.nn.log_sigmoid(z)) / jnp.sum(counted)
    elif objective == "grpo":
        g = cfg.grpo
        logps = _token_logps(logits / g.temperature, rows["targets"])
        ratio = jnp.exp(logps - rows["old_logps"])
        adv = rows["advantages"]
        high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - g.epsilon, 1 + high) * adv)
        d = jax.lax.stop_gradient(logps) - logps  # k3 KL against the initial policy
        per_token = per_token + g.beta * (jnp.exp(d) - d - 1)
        loss = jnp.sum(rows["loss_weight"] * per_token)
    else:
        loss = _mean_ce(logits, rows["targets"], mask)
    value = loss
    moe_terms = None
    if mcfg.moe is not None:
        moe_terms = {k: aux[f"moe_{k}"] for k in ("aux_loss", "z_loss")}
    if mcfg.mtp is not None:
        normed, stats = model.predict_ahead(
            residual, rows["inputs"], rows["targets"], positions=rows["positions"], segment_ids=seg
        )
        ce = []
        for k in range(1, mcfg.mtp.depth + 1):
            tgt, m = _lookahead(rows, k)
            ce.append(_mean_ce(_logits(normed[k - 1], whole, cfg), tgt, m))
        value = value + mcfg.mtp.loss_weight * jnp.mean(jnp.stack(ce))
        if moe_terms is not None:  # the modules' MoE layers join the main layers' averages
            main = mcfg.n_layers
            moe_terms = {
                k: (main * v + jnp.sum(stats[k])) / (main + mcfg.mtp.depth) for k, v in moe_terms.items()
            }
    if moe_terms is not None:
        value = (
            value
            + mcfg.moe.aux_loss_weight * moe_terms["aux_loss"]
            + mcfg.moe.z_loss_weight * moe_terms["z_loss"]
        )
    return value, loss


# --- the update by hand (oracle 2) -----------------------------------------------------------

_MUON_NAMES = {
    "wq",
    "wk",
    "wv",
    "wo",
    "wq_a",
    "wq_b",
    "wkv_a",
    "wkv_b",
    "w_gate",
    "w_up",
    "w_down",
    "eh_proj",
    # gated DeltaNet's projections from and to the residual stream (in_proj_a / b, one scalar per
    # value head, and the conv weight, which reads no embedding, stay AdamW's)
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
}
_EXPERT_NAMES = {"w_gate", "w_up", "w_down"}


def _role(path: tuple[str, ...], shape) -> tuple[str, bool, int, int]:
    """(optimizer, decays, stacked dims, input dims) of a parameter by its name: norm scales,
    biases and attention sinks never decay; hidden matrices (attention projections, MLP and
    expert weights, latent attention's projections, the prediction modules' eh_proj) go to
    Muon, each layer's (each expert's, each module's) [in, out] matrix: `wo` reads two input
    dims (heads, head_dim), the others one; everything else (embedding, head, routers, norms,
    sinks, LoRA adapters) to AdamW."""
    name = path[-1]
    # (gated DeltaNet's output norm `norm`, its decay rate A_log and its dt_bias: none either)
    decays = name not in ("scale", "sinks", "norm", "A_log") and "bias" not in name
    in_lora = any(p.endswith("_lora") for p in path)
    if name in _MUON_NAMES and not in_lora:
        stack = 2 if name in _EXPERT_NAMES and len(shape) == 4 else 1
        return "muon", decays, stack, 2 if name in ("wo", "out_proj") else 1
    return "adamw", decays, 0, 0


def reference_first_update(params: dict, grads: dict, cfg) -> dict:
    """The first step's move of every trained parameter, in float64 numpy."""
    o = cfg.optimizer
    lr = o.lr  # no warmup: the schedule's first value
    flat = {p: np.asarray(g, np.float64) for p, g in _flat(grads).items()}
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in flat.values()))
    clip = 1.0 if o.clip_norm is None or norm < o.clip_norm else o.clip_norm / norm
    out = {}
    for path, p in _flat(params).items():
        g, p = flat[path] * clip, np.asarray(p, np.float64)
        kind, decays, stack, n_in = _role(path, p.shape)
        if kind == "adamw" or o.name == "adamw":
            # first step from zero moments: m_hat = g, v_hat = g^2
            out[path] = -lr * (g / (np.abs(g) + o.eps) + (o.weight_decay * p if decays else 0.0))
            continue
        m = o.muon
        wd = o.weight_decay if m.weight_decay is None else m.weight_decay
        u = (1 - m.momentum) * g * (1 + m.momentum if m.nesterov else 1)  # buf = (1 - m) g
        lead = p.shape[:stack]
        n_rows = math.prod(p.shape[stack : stack + n_in])
        mats = u.reshape(*lead, n_rows, -1)
        ortho = np.stack([newton_schulz_np(x) for x in mats.reshape(-1, *mats.shape[-2:])])
        ratio = 0.2 * math.sqrt(max(mats.shape[-2:]))  # match_rms_adamw
        muon_lr = lr if m.lr is None else m.lr
        out[path] = -muon_lr * wd * p - muon_lr * ratio * ortho.reshape(p.shape)
    return out


def _flat(tree) -> dict:
    return {tuple(k.key for k in path): v for path, v in jax.tree_util.tree_leaves_with_path(tree)}


# --- the pairs a row checks -------------------------------------------------------------------


def _pair_names(pairs) -> list[str]:
    out = []
    for a, b in pairs:
        a, b = compose.pair(a, b)
        if a != b and f"{a}+{b}" not in out and not isinstance(compose.status(a, b), compose.Refused):
            out.append(f"{a}+{b}")
    return out


def oracle_pairs(features) -> list[str]:
    """Objective x model feature, optimizer x model feature, objective x optimizer; and where
    the objective's oracle writes the meeting itself: the prediction modules' router losses
    joining the main layers' (moe+mtp), the softcap on the prediction modules' logits
    (mtp+final_softcap) and on the main logits of a body with each model feature."""
    obj, opt = objective_of(features), next(f for f in features if f in OPTIMIZERS)
    model = [f for f in features if f in MODEL]
    pairs = [(obj, f) for f in model] + [(opt, f) for f in model] + [(obj, opt)]
    for a, b in (("moe", "mtp"), ("mtp", "final_softcap")):
        if a in features and b in features:
            pairs.append((a, b))
    if "final_softcap" in features:  # the cap, by hand, on the head of whatever body the row has
        pairs += [("final_softcap", f) for f in model if f not in ("final_softcap", "mtp")]
    return _pair_names(pairs)


def low_pairs(low_features) -> list[str]:
    """Each 16-bit feature with every other feature of its row."""
    row, extra = LOW_ROWS[low_features]
    every = (*ROWS[row], *extra)
    return _pair_names((a, b) for a in extra for b in every)


def _param(name, pairs, xfail=None):
    marks = [pytest.mark.composes(*pairs)]
    if xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=xfail))
    return pytest.param(name, id=name, marks=marks)


XFAIL: dict[str, str] = {}  # row id -> the seam defect that makes its oracle fail (strict)


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("row", [_param(r, oracle_pairs(f), XFAIL.get(r)) for r, f in ROWS.items()])
def test_objective_and_update_equal_plain_oracles(row):
    got = run(ROWS[row], True)
    cfg = got["cfg"]
    loss, grads = got["loss_and_grads"]
    ref_loss, ref_grads = got["plain"]
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL, err_msg="loss")
    np.testing.assert_allclose(got["loss"][0], ref_loss, rtol=LOSS_RTOL, err_msg="the step's loss")
    flat_ref = _flat(ref_grads)
    assert _flat(grads).keys() == flat_ref.keys()
    for path, g in _flat(grads).items():
        np.testing.assert_allclose(g, flat_ref[path], rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=f"grad {path}")
        # (a LoRA adapter's A has none while its B is zero, as LoRA starts)
        if not (path[-1] == "a" and path[-2].endswith("_lora")):
            assert np.abs(flat_ref[path]).max() > 0, f"no gradient reaches {path}"
    want = reference_first_update(got["params"], grads, cfg)
    moved = _flat(got["moves"][0])
    assert moved.keys() == want.keys()
    for path, w in want.items():
        np.testing.assert_allclose(moved[path], w, rtol=0, atol=MOVE_ATOL, err_msg=f"update {path}")


@pytest.mark.parametrize("row", [_param(r, low_pairs(r), XFAIL.get(r)) for r in LOW_ROWS])
def test_low_precision_tracks_float32(row):
    """The first step's loss (against max(|loss|, 1): GRPO's is near 0), gradient norm and each
    parameter's move (relative Frobenius norm: an expert choice that flips in 16 bits moves a
    few elements far) within the tolerance of its 16-bit features; both steps finite."""
    base, extra = LOW_ROWS[row]
    tol = {k: max(LOW_TOL[f][k] for f in extra) for k in ("loss", "grad_norm", "move")}
    got, want = run((*ROWS[base], *extra), False), run(ROWS[base], True)
    assert np.all(np.isfinite(got["loss"])) and np.all(np.isfinite(got["grad_norm"]))
    errors = {
        "loss": abs(got["loss"][0] - want["loss"][0]) / max(abs(want["loss"][0]), 1.0),
        "grad_norm": abs(got["grad_norm"][0] / want["grad_norm"][0] - 1),
    }
    a, b = _flat(got["moves"][0]), _flat(want["moves"][0])
    assert a.keys() == b.keys()
    for path, x in a.items():
        assert all(np.all(np.isfinite(_flat(m)[path])) for m in got["moves"]), path
        errors[path] = float(np.linalg.norm(x - b[path]) / max(np.linalg.norm(b[path]), 1e-6))
    wrong = {k: v for k, v in errors.items() if v > tol["move" if isinstance(k, tuple) else k]}
    assert not wrong, (tol, wrong)


def test_each_row_switches_on_exactly_its_features():
    """Each row's config is accepted on one device and switches on what the row says (chat's
    predicate reads a data manifest, which these rows have not: lm stands for it)."""
    for features in [*ROWS.values(), *((*ROWS[b], *e) for b, e in LOW_ROWS.values())]:
        cfg = tiny_config(None, *overrides(features))
        validate(cfg, 1)
        want = {"lm" if f == "chat" else f for f in features} | (
            {"dense"} if "moe" not in features else set()
        )
        assert set(compose.active(cfg)) == want, features
