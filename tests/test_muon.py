"""Muon (optimizer.name: muon; jaxtrain/trainer/muon.py) against torch.optim.Muon, on meshes.

The oracle is tests/assets/muon/ (tests/assets/make_muon_assets.py, torch 2.14): a tiny HF
Llama (GQA, q_proj tall, k_proj wide) trained 12 steps in float32 by torch.optim.Muon
(the hidden matrices, Newton-Schulz patched to float32, adjust_lr_fn match_rms_adamw) plus
torch.optim.AdamW (embeddings and LM head decayed, norm scales not), global-norm clipping
first, one warmup-cosine schedule with each optimizer's own peak. jaxtrain trains the same
converted model on the same batches on data=2 x fsdp=2 and fsdp=2 x tensor=2; a variant that
orthogonalises each attention head on its own (not HF's whole q_proj) must miss it.
"""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import models, sharding
from jaxtrain.config import ConfigError, MuonConfig
from jaxtrain.interchange.convert import hf_to_ckpt
from jaxtrain.models.hf import config_from_hf, load_hf_params, read_hf_config
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.recovery.checkpoint import abstract_state
from jaxtrain.trainer import muon
from jaxtrain.trainer.batches import batch_to_device
from jaxtrain.trainer.loop import initial_state
from jaxtrain.trainer.optimizer import learning_rate_schedule, make_optimizer, muon_labels
from jaxtrain.trainer.program import build_program
from tests.conftest import program_on_mesh, replace, tiny_config

ASSETS = Path(__file__).parent / "assets" / "muon"
EXPECTED = json.loads((ASSETS / "expected.json").read_text())
HF_CFG = config_from_hf(read_hf_config(ASSETS / "initial"))
ARCH_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "mlp_dim",
    "norm_eps",
    "rope_theta",
    "tie_embeddings",
    "init_std",
)
# f32 on both sides, one device in torch: summation orders differ (and XLA's matmuls are not
# torch's). Measured when this was written: losses within 4.8e-7 (data x fsdp) and 7.2e-7
# (fsdp x tensor), weights within 2.4e-7 and 2.5e-7
TOL = 1e-5


@pytest.fixture(scope="module")
def init_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon_init")
    hf_to_ckpt(ASSETS / "initial", out / "ckpt")
    return out / "ckpt"


def muon_config(tmp_path, init_ckpt, *overrides):
    """The oracle's run: its model, batches, optimizers and schedule, f32."""
    o, m = EXPECTED["optimizer"], EXPECTED["muon"]
    cfg = tiny_config(
        tmp_path,
        f"train.init_from={init_ckpt}",
        "train.global_batch_size=8",
        "train.seq_len=16",
        f"train.steps={EXPECTED['steps']}",
        "train.loss_chunk=0",
        "optimizer.name=muon",
        *(f"optimizer.{k}={o[k]}" for k in o),
        *(f"optimizer.muon.{k}={v}" for k, v in m.items() if k != "ns_coefficients"),
        f"optimizer.muon.ns_coefficients={m['ns_coefficients']}",
        "optimizer.muon.ns_dtype=float32",
        "model.remat=none",
        *overrides,
    )
    return replace(cfg, model={k: getattr(HF_CFG, k) for k in ARCH_KEYS})


def oracle_batches():
    data = np.load(ASSETS / "batches.npz")
    steps, rows, seq = data["inputs"].shape
    for s in range(steps):
        yield {
            "inputs": data["inputs"][s],
            "targets": data["targets"][s],
            "loss_mask": np.ones((rows, seq), np.float32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
            "segment_ids": np.ones((rows, seq), np.int32),
        }


def train(cfg):
    """(losses, final params as numpy, program) of cfg's run over the oracle's batches."""
    n = math.prod(cfg.mesh.sizes().values())
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:n])
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        state = initial_state(cfg, program, abstract_state(program), lambda _: None)
        losses = []
        for rows in oracle_batches():
            state, metrics = program.step(state, batch_to_device(rows, program.batch_sharding))
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params), program, state


def max_weight_error(params) -> float:
    want = load_hf_params(ASSETS / "final", HF_CFG)
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    got = jax.tree.leaves(params)
    assert len(got) == len(flat_want)
    return max(float(np.max(np.abs(np.asarray(g) - w))) for (_, w), g in zip(flat_want, got))


@pytest.mark.composes("lm+muon", "dense+muon", "fsdp+muon")
@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param("mesh.data=2 mesh.fsdp=2", marks=pytest.mark.composes("data+muon")),
        pytest.param("mesh.fsdp=2 mesh.tensor=2", marks=pytest.mark.composes("tensor+muon")),
    ],
)
def test_muon_equals_torch_muon_on_meshes(tmp_path, init_ckpt, mesh):
    cfg = muon_config(tmp_path, init_ckpt, *mesh.split())
    losses, params, program, _ = train(cfg)
    np.testing.assert_allclose(losses, EXPECTED["losses"], rtol=0, atol=TOL)
    assert max_weight_error(params) < TOL
    # the hidden matrices really are sharded here: Newton-Schulz saw them whole all the same
    wq = program.state_shardings.params["blocks"]["attn"]["wq"]
    assert wq.spec != jax.sharding.PartitionSpec() and any(a is not None for a in wq.spec)


class PerHeadView(muon.MatrixView):
    """The wrong matrix: each attention head's [d_model, head_dim] slice on its own."""

    def matrices(self, x):  # [layers, d, h, hd] -> [layers, h, d, hd]
        return jnp.moveaxis(x, 2, 1)

    def from_matrices(self, m, shape):
        return jnp.moveaxis(m, 1, 2)


def test_per_head_orthogonalisation_fails_the_oracle(tmp_path, init_ckpt, monkeypatch):
    """The same run with q/k/v orthogonalised per head (as a jaxtrain layout [d, heads, hd]
    invites) is far outside TOL of torch's: the test above can tell the two apart."""
    whole = muon.matrix_view

    def per_head(axes):
        view = whole(axes)
        if tuple(axes[-3:]) in (("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")):
            return PerHeadView(view.n_stack, view.n_in)
        return view

    monkeypatch.setattr(muon, "matrix_view", per_head)
    losses, params, _, _ = train(muon_config(tmp_path, init_ckpt))
    assert max_weight_error(params) > 100 * TOL
    assert np.max(np.abs(np.asarray(losses) - EXPECTED["losses"])) > 10 * TOL


# --- the pieces, against numpy -----------------------------------------------------------------


def newton_schulz_np(g: np.ndarray, steps=5, coefficients=(3.4445, -4.775, 2.0315), eps=1e-7):
    """torch's iteration in float64 numpy, on one [out, in] matrix."""
    a, b, c = coefficients
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / max(np.linalg.norm(x), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_newton_schulz_equals_numpy_and_commutes_with_transposition():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(3, 12, 7)).astype(np.float32)  # a stack of tall matrices
    got = np.asarray(muon.newton_schulz(jnp.asarray(g), (3.4445, -4.775, 2.0315), 5, 1e-7, jnp.float32))
    want = np.stack([newton_schulz_np(x.astype(np.float64)) for x in g])
    np.testing.assert_allclose(got, want, atol=2e-6)
    got_t = muon.newton_schulz(jnp.asarray(g).swapaxes(1, 2), (3.4445, -4.775, 2.0315), 5, 1e-7, jnp.float32)
    np.testing.assert_allclose(np.asarray(got_t).swapaxes(1, 2), got, atol=1e-7)
    # singular values near 1 (the quintic's band, Keller Jordan's ~(0.7, 1.2) after 5 steps)
    s = np.linalg.svd(want[0], compute_uv=False)
    assert 0.6 < s.min() and s.max() < 1.3


def test_views_labels_and_hf_shapes_of_dense_and_moe_models():
    cfg = tiny_config(None, "model.moe={num_experts: 4, top_k: 2, num_shared_experts: 1}").model
    _, state = models.abstract_model(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
    axes, shapes = models.logical_axes(state), nnx.to_pure_dict(state)
    labels = muon_labels(axes)
    mlp = labels["moe_blocks"]["mlp"]
    assert mlp["w_router"] == "adamw" and mlp.get("router_bias", "adamw") == "adamw"
    experts = ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")
    assert {mlp[k] for k in experts} == {"muon"}
    assert labels["embedding"] == labels["lm_head"] == labels["final_norm"]["scale"] == "adamw"
    assert set(jax.tree.leaves(labels["moe_blocks"]["attn"])) == {"muon"}
    d, hd, h, kv, f = cfg.d_model, cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.moe.mlp_dim(cfg)
    hf = lambda *path: muon.matrix_view(_at(axes, path)).hf_shape(_at(shapes, path).shape)
    assert hf("moe_blocks", "attn", "wq") == (h * hd, d)  # q_proj, whole
    assert hf("moe_blocks", "attn", "wk") == (kv * hd, d)
    assert hf("moe_blocks", "attn", "wo") == (d, h * hd)
    assert hf("moe_blocks", "mlp", "w_gate") == (f, d)  # one expert's gate_proj
    assert hf("moe_blocks", "mlp", "w_down") == (d, f)
    view = muon.matrix_view(_at(axes, ("moe_blocks", "mlp", "w_up")))
    assert view.n_stack == 2  # [layers, experts, d, f]: each layer's and each expert's own


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@pytest.mark.composes("moe+muon")
def test_one_step_of_stacked_expert_matrices_equals_a_loop_over_matrices():
    """Muon on [layers, experts, d, f] (each expert's own matrix, gate and up apart), with
    `original` lr on a tall HF shape, against numpy matrix by matrix."""
    rng = np.random.default_rng(1)
    p = rng.normal(size=(2, 3, 6, 10)).astype(np.float32)  # HF [out 10, in 6]: tall
    g1, g2 = (rng.normal(size=p.shape).astype(np.float32) for _ in range(2))
    cfg = MuonConfig(adjust_lr="original", momentum=0.9)
    lr, wd = 0.1, 0.2
    view = muon.matrix_view(("layers", "expert", "embed", "mlp"))
    tx = muon.muon(cfg, lambda count: lr * (count + 1), wd, {"w": view})
    state = tx.init({"w": jnp.asarray(p)})
    params, buf = p.astype(np.float64), np.zeros(p.shape)
    for t, g in enumerate((g1, g2)):
        u, state = tx.update({"w": jnp.asarray(g)}, state, {"w": jnp.asarray(params, jnp.float32)})
        lr_t = lr * (t + 1)
        buf = 0.9 * buf + 0.1 * g
        nesterov = 0.1 * g + 0.9 * buf
        new = np.empty_like(params)
        for i in np.ndindex(2, 3):  # torch: the [out, in] matrix, its own lr adjustment
            o = newton_schulz_np(nesterov[i].T).T
            new[i] = params[i] * (1 - lr_t * wd) - lr_t * math.sqrt(max(1, 10 / 6)) * o
        np.testing.assert_allclose(np.asarray(u["w"]), new - params, atol=2e-6)
        params = new


MLA = "model.mla={q_lora_rank: 12, kv_lora_rank: 10, qk_nope_head_dim: 6, qk_rope_head_dim: 4, v_head_dim: 5}"


def hf_matrices_of_mla(attn: dict, h: int) -> dict:
    """HF's [out, in] tensors of one layer's latent attention, written out (models/hf/deepseek.py's
    DeepSeek-V3 mapping, independently): q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
    o_proj."""
    flat = lambda w: w.reshape(w.shape[0], -1)  # [in, heads, width] -> [in, heads * width]
    return {
        "q_a_proj": attn["wq_a"].T,  # [q_lora, D]
        "q_b_proj": flat(attn["wq_b"]).T,  # [H * (nope + rope), q_lora]
        "kv_a_proj_with_mqa": attn["wkv_a"].T,  # [kv_lora + rope, D]: latent and RoPE key, one matrix
        "kv_b_proj": flat(attn["wkv_b"]).T,  # [H * (nope + v), kv_lora]
        "o_proj": attn["wo"].reshape(h * attn["wo"].shape[1], -1).T,  # [D, H * v]
    }


@pytest.mark.composes("mla+muon")
def test_one_step_of_latent_attention_equals_torch_muon_on_hfs_matrices():
    """Muon on an MLA model's attention: each of wq_a, wq_b, wkv_a (the shared RoPE key's
    columns with the latent's), wkv_b and wo orthogonalised as the one [out, in] matrix HF
    stores, its lr adjusted by that shape; the latent norms AdamW's. Oracle: torch's update
    in float64 numpy on the HF tensors, mapped back; tolerance 2e-6 (float32 iteration)."""
    cfg = tiny_config(None, MLA, "model.n_kv_heads=4").model
    h, d = cfg.n_heads, cfg.d_model
    _, state = models.abstract_model(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
    axes, shapes = models.logical_axes(state), nnx.to_pure_dict(state)
    labels = muon_labels(axes)["blocks"]["attn"]
    assert labels["q_norm"]["scale"] == labels["kv_norm"]["scale"] == "adamw"
    names = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")
    assert all(labels[k] == "muon" for k in names)
    # a plain query projection (q_lora_rank null) is HF's q_proj, whole
    plain = tiny_config(None, MLA.replace("q_lora_rank: 12", "q_lora_rank: null"), "model.n_kv_heads=4").model
    _, plain_state = models.abstract_model(lambda: models.Transformer(plain, rngs=nnx.Rngs(0)))
    wq = muon.matrix_view(models.logical_axes(plain_state)["blocks"]["attn"]["wq"])
    assert wq.hf_shape(nnx.to_pure_dict(plain_state)["blocks"]["attn"]["wq"].shape) == (h * 10, d)

    rng = np.random.default_rng(2)
    attn_shapes = {k: shapes["blocks"]["attn"][k].shape for k in names}
    p = {k: rng.normal(size=v).astype(np.float32) for k, v in attn_shapes.items()}
    g = {k: rng.normal(size=v).astype(np.float32) for k, v in attn_shapes.items()}
    views = {k: muon.matrix_view(axes["blocks"]["attn"][k]) for k in names}
    lr, wd = 0.05, 0.1
    tx = muon.muon(MuonConfig(), lambda count: lr, wd, views)
    jp = jax.tree.map(jnp.asarray, p)
    got, _ = tx.update(jax.tree.map(jnp.asarray, g), tx.init(jp), jp)

    for layer in range(cfg.n_layers):
        mine = lambda tree: {k: v[layer].astype(np.float64) for k, v in tree.items()}
        hf_p, hf_g = hf_matrices_of_mla(mine(p), h), hf_matrices_of_mla(mine(g), h)
        hf_new = {}
        for name, w in hf_p.items():  # torch.optim.Muon's first step: buf = 0.05 g, u = 0.05 g + 0.95 buf
            u = 0.05 * hf_g[name] + 0.95 * (0.05 * hf_g[name])
            adjusted = lr * 0.2 * math.sqrt(max(w.shape))  # match_rms_adamw on HF's [out, in]
            hf_new[name] = w * (1 - lr * wd) - adjusted * newton_schulz_np(u)
        want = {  # back to our layouts
            "wq_a": hf_new["q_a_proj"].T,
            "wq_b": hf_new["q_b_proj"].T.reshape(attn_shapes["wq_b"][1:]),
            "wkv_a": hf_new["kv_a_proj_with_mqa"].T,
            "wkv_b": hf_new["kv_b_proj"].T.reshape(attn_shapes["wkv_b"][1:]),
            "wo": hf_new["o_proj"].T.reshape(attn_shapes["wo"][1:]),
        }
        for k in names:
            np.testing.assert_allclose(np.asarray(got[k][layer]), want[k] - p[k][layer], atol=2e-6, err_msg=k)


def hf_matrices_of_mtp(module: dict, d: int) -> dict:
    """HF's [out, in] tensors of one prediction module (DeepSeek-V3's `model.layers.{L + k}`),
    written out: eh_proj [d, 2d] (embedding half first), the block's q/k/v/o and gate/up/down."""
    attn, mlp = module["block"]["attn"], module["block"]["mlp"]
    heads_out = lambda w: w.reshape(d, -1).T  # [d, heads, hd] -> [heads * hd, d]
    return {
        "eh_proj": module["eh_proj"].T,
        "q_proj": heads_out(attn["wq"]),
        "k_proj": heads_out(attn["wk"]),
        "v_proj": heads_out(attn["wv"]),
        "o_proj": attn["wo"].reshape(-1, d).T,  # [d, H * hd]
        "gate_proj": mlp["w_gate"].T,
        "up_proj": mlp["w_up"].T,
        "down_proj": mlp["w_down"].T,
    }


def _mtp_ours(hf: dict, like: dict) -> dict:
    """`hf_matrices_of_mtp`'s inverse, into the layouts of `like` (one module's params)."""
    attn = like["block"]["attn"]
    return {
        "eh_proj": hf["eh_proj"].T,
        "block": {
            "attn": {
                "wq": hf["q_proj"].T.reshape(attn["wq"].shape),
                "wk": hf["k_proj"].T.reshape(attn["wk"].shape),
                "wv": hf["v_proj"].T.reshape(attn["wv"].shape),
                "wo": hf["o_proj"].T.reshape(attn["wo"].shape),
            },
            "mlp": {
                k: hf[n].T for k, n in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
            },
        },
    }


@pytest.mark.composes("muon+mtp")
def test_one_step_of_the_prediction_modules_equals_torch_muon_per_depth():
    """optimizer.name=muon with model.mtp (depth 2): each module's eh_proj and its block's
    attention and MLP projections are Muon's, one [out, in] matrix per depth as HF stores it
    (eh_proj: [d_model, 2 d_model]), their lr adjusted by that shape; the modules' norms stay
    AdamW's. Oracle: torch.optim.Muon's first step in float64 numpy on the HF tensors, mapped
    back (tolerance 2e-6: float32 iteration), and AdamW's first step (-lr g / (|g| + eps))
    for the norms. Before the fix every module matrix took AdamW's update."""
    cfg = tiny_config(
        None, "model.d_model=32", "model.mlp_dim=48", "model.vocab_size=64", "model.mtp={depth: 2}",
        "optimizer.name=muon", "optimizer.warmup_steps=0", "optimizer.clip_norm=null",
    )  # fmt: skip
    m, o = cfg.model, cfg.optimizer
    _, state = models.abstract_model(lambda: models.Transformer(m, rngs=nnx.Rngs(0)))
    axes, shapes = models.logical_axes(state), nnx.to_pure_dict(state)
    labels = muon_labels(axes)["mtp"]
    matrices = {"eh_proj": labels["eh_proj"], **labels["block"]["attn"], **labels["block"]["mlp"]}
    assert set(matrices.values()) == {"muon"}, matrices
    norms = ("enorm", "hnorm", "head_norm")
    assert {labels[k]["scale"] for k in norms} | {
        labels["block"][k]["scale"] for k in ("attn_norm", "mlp_norm")
    } == {"adamw"}
    d = m.d_model
    eh = muon.matrix_view(axes["mtp"]["eh_proj"])
    assert eh.n_stack == 1 and eh.hf_shape(shapes["mtp"]["eh_proj"].shape) == (d, 2 * d)

    rng = np.random.default_rng(3)
    p = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), shapes)
    g = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), shapes)
    tx = make_optimizer(o, cfg.train.steps, param_axes=axes)
    jp = jax.tree.map(jnp.asarray, p)
    got, _ = tx.update(jax.tree.map(jnp.asarray, g), tx.init(jp), jp)
    got = jax.device_get(got)["mtp"]
    lr = float(learning_rate_schedule(o, cfg.train.steps)(0))
    wd, mu = o.weight_decay, o.muon.momentum
    assert lr == pytest.approx(o.lr) and o.muon.lr is None and o.muon.weight_decay is None

    for depth in range(m.mtp.depth):
        one = lambda tree: jax.tree.map(lambda x: x[depth].astype(np.float64), tree)
        mp, mg = one(p["mtp"]), one(g["mtp"])
        hf_p, hf_g = hf_matrices_of_mtp(mp, d), hf_matrices_of_mtp(mg, d)
        hf_step = {}
        for name, w in hf_p.items():  # torch.optim.Muon's first step (nesterov)
            u = (1 - mu) * hf_g[name] + mu * ((1 - mu) * hf_g[name])
            adjusted = lr * 0.2 * math.sqrt(max(w.shape))  # match_rms_adamw on HF's [out, in]
            hf_step[name] = -lr * wd * w - adjusted * newton_schulz_np(u)
        want = _mtp_ours(hf_step, mp)
        mine = one(got)
        close = lambda a, b, path: np.testing.assert_allclose(
            a, b, atol=2e-6, err_msg=f"depth {depth} {path}"
        )
        close(mine["eh_proj"], want["eh_proj"], "eh_proj")
        for part in ("attn", "mlp"):
            for k, w in want["block"][part].items():
                close(mine["block"][part][k], w, k)
        for k in norms:  # AdamW's first step, not decayed
            gk = mg[k]["scale"]
            close(mine[k]["scale"], -lr * gk / (np.abs(gk) + o.eps), k)


def test_prediction_modules_of_a_deepseek_model_are_muons_per_depth_and_expert():
    """DeepSeek-V3's shape (MLA, MoE, MTP): a module's latent-attention projections and each of
    its experts' matrices are Muon's, stacked on (mtp_depth[, expert]); its router AdamW's."""
    cfg = tiny_config(
        None, MLA, "model.n_kv_heads=4", "model.mtp={depth: 2}",
        "model.moe={num_experts: 4, top_k: 2, num_shared_experts: 1}",
    ).model  # fmt: skip
    _, state = models.abstract_model(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
    axes = models.logical_axes(state)["mtp"]
    labels = muon_labels(axes)
    assert all(labels["block"]["attn"][k] == "muon" for k in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"))
    mlp = labels["block"]["mlp"]
    assert mlp["w_router"] == "adamw"
    assert {mlp[k] for k in ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")} == {
        "muon"
    }
    assert muon.matrix_view(axes["block"]["mlp"]["w_up"]).n_stack == 2  # [depth, experts, d, f]
    assert muon.matrix_view(axes["block"]["attn"]["wkv_b"]).n_stack == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.name=sgd", "optimizer.name='sgd': expected one of adamw, muon"),
        ("optimizer.muon.adjust_lr=spectral", "optimizer.muon.adjust_lr='spectral'"),
        ("optimizer.muon.ns_dtype=float16", "optimizer.muon.ns_dtype='float16'"),
        ("optimizer.muon.momentum=1.0", "optimizer.muon.momentum=1.0"),
        ("optimizer.muon.ns_steps=0", "optimizer.muon.ns_steps=0"),
        ("optimizer.muon.ns_coefficients=[1, 2]", "optimizer.muon.ns_coefficients=[1.0, 2.0]"),
        ("optimizer.state_dtype=float16", "optimizer.state_dtype='float16'"),
        ("optimizer.qk_clip.tau=0", "optimizer.qk_clip.tau=0"),
    ],
)
def test_bad_optimizer_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=None) as e:
        tiny_config(None, override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_defaults_are_the_issues():
    m = MuonConfig()
    assert dataclasses.asdict(m) == {
        "momentum": 0.95,
        "nesterov": True,
        "ns_steps": 5,
        "ns_coefficients": (3.4445, -4.775, 2.0315),
        "eps": 1e-7,
        "adjust_lr": "match_rms_adamw",
        "lr": None,
        "weight_decay": None,
        "ns_dtype": "float32",
    }


# --- every mesh the step runs on: the single-device run is the oracle ---------------------------

MESH_STEPS = 3


def moe_config(*overrides):
    """A small MoE model (4 experts of 32, top-2: each expert's gate, up and down its own Muon
    matrix) with Muon. No router losses: a pipeline computes them per microbatch, which is
    another objective than the whole batch's."""
    return tiny_config(
        None,
        "model.d_model=32",
        "model.mlp_dim=64",
        "model.vocab_size=64",
        "model.moe={num_experts: 4, top_k: 2, expert_mlp_dim: 32, aux_loss_weight: 0, z_loss_weight: 0}",
        "train.seq_len=16",
        "train.global_batch_size=8",
        "train.loss_chunk=0",
        "optimizer.name=muon",
        "optimizer.warmup_steps=0",
        *overrides,
    )


def mesh_run(cfg):
    """Losses and final params of MESH_STEPS steps on cfg's mesh (synthetic data)."""
    with program_on_mesh(cfg) as (program, state, data):
        losses = []
        for _ in range(MESH_STEPS):
            state, metrics = program.step(state, batch_to_device(next(data), program.batch_sharding))
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device_run():
    return mesh_run(moe_config())


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        # experts and heads split over devices, the state also over data (ZeRO-1)
        pytest.param(
            ("mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "optimizer.shard_state=true"),
            marks=pytest.mark.composes(
                "expert+muon", "muon+zero1", "moe+zero1", "expert+zero1", "tensor+zero1"
            ),
        ),
        # the layers over pipeline stages, FSDP inside, master weights and state on the host
        pytest.param(
            ("mesh.stage=2", "mesh.fsdp=2", "optimizer.offload=true", "optimizer.offload_params=true"),
            marks=pytest.mark.composes("gpipe+muon", "muon+offload", "moe+offload", "gpipe+offload"),
        ),
    ],
    ids=["data-expert-tensor-zero1", "stage-fsdp-offload"],
)
def test_muon_on_expert_pipeline_zero1_and_offload_meshes_equals_one_device(one_device_run, overrides):
    # f32, 3 steps: sharded reductions change summation orders only
    want_losses, want = one_device_run
    losses, got = mesh_run(moe_config(*overrides))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
