"""DPO (train.objective=dpo): the loss and metrics, preference data, resume and memory.

Oracles: a plain torch DPO loop on the tiny HF Llama (tests/assets/make_dpo_assets.py:
reference = a deep copy of the initial model under no_grad, AdamW, f32), per-step losses,
gradient norms and TRL's reward metrics on the same batches (rtol 1e-5 on the loss and the
gradient norm, atol 1e-5 on the rewards, which are differences of ~50-nat log-prob sums);
ln 2 for the first step (rtol 1e-6); numpy for the loss formula; the tokenizer and
`encode_chat` for the pairs' tokens and masks, laid out by hand; an uninterrupted run for
resume (bit for bit on CPU); parameter bytes for the memory model and the compiled step."""

import dataclasses
import gzip
import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain import models, sharding
from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import DataError, encode_chat, make_data_iterator
from jaxtrain.data.tokenize import run_tokenize
from jaxtrain.data.tokenizers import HFTokenizer
from jaxtrain.interchange.convert import hf_to_ckpt, load_params
from jaxtrain.models import lora
from jaxtrain.planning.footprint import estimate
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.recovery.checkpoint import abstract_state
from jaxtrain.trainer import dpo
from jaxtrain.trainer.loop import initial_state
from jaxtrain.trainer.program import build_program
from tests.conftest import REPO, replace, tiny_config
from tests.test_tokenize import parse
from tests.test_tokens_data import Cfg

ASSETS = Path(__file__).parent / "assets"
CHATML = ASSETS / "chat" / "chatml"


@pytest.fixture(scope="module")
def oracle():
    with gzip.open(ASSETS / "dpo" / "expected.json.gz", "rt") as f:
        return json.load(f)


def test_dpo_sums_by_hand():
    """The loss with label smoothing, TRL's metrics, and pairs without a response left out."""
    rng = np.random.default_rng(0)
    logps, ref = rng.normal(-30, 5, (5, 2)), rng.normal(-30, 5, (5, 2))
    mask = np.ones((5, 2, 8), np.float32)
    mask[3, 1] = 0  # pair 3's rejected response was cut off: not counted
    beta, ls = 0.3, 0.2
    total, count, sums = dpo.dpo_sums(logps, ref, dpo.counted_pairs(mask), beta=beta, label_smoothing=ls)
    keep = [0, 1, 2, 4]
    r = beta * (logps - ref)[keep]
    z = r[:, 0] - r[:, 1]
    logsig = lambda x: -np.log1p(np.exp(-x))
    want = -(1 - ls) * logsig(z) - ls * logsig(-z)
    assert float(count) == 4
    np.testing.assert_allclose(float(total), want.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(sums["dpo/chosen_reward"]), r[:, 0].sum(), rtol=1e-6)
    np.testing.assert_allclose(float(sums["dpo/rejected_reward"]), r[:, 1].sum(), rtol=1e-6)
    np.testing.assert_allclose(float(sums["dpo/reward_margin"]), z.sum(), rtol=1e-6)
    assert float(sums["dpo/accuracy"]) == np.sum(z > 0)


def _hf_config(tmp_path, *overrides):
    """A config whose model is the tiny HF Llama, converted for train.init_from."""
    model_cfg = hf_to_ckpt(ASSETS / "hf" / "llama_gqa_rope_llama3", tmp_path / "ckpt")
    model = [
        f"model.{k}={v}"
        for k, v in dataclasses.asdict(model_cfg).items()
        if v not in (None, ()) and not isinstance(v, dict)
    ]
    return tiny_config(
        tmp_path,
        *model,
        "data.source=tokens",
        "data.paths=[unused]",
        f"train.init_from={tmp_path / 'ckpt'}",
        *overrides,
    )


@pytest.mark.composes("dpo+dense", "dpo+data", "dpo+fsdp", "dpo+adamw")
def test_dpo_steps_equal_torch_on_a_data_fsdp_mesh(tmp_path, oracle):
    """Four DPO steps from the HF model's weights on data=2 x fsdp=2: the first loss is ln 2
    (policy == reference, with label smoothing too), and every step's loss, gradient norm and
    reward metrics equal the torch loop's."""
    h = oracle["hparams"]
    cfg = _hf_config(
        tmp_path,
        "train.objective=dpo",
        f"dpo.beta={h['beta']}",
        f"dpo.label_smoothing={h['label_smoothing']}",
        "mesh.data=2",
        "mesh.fsdp=2",
        "train.global_batch_size=4",
        "train.seq_len=16",
        f"train.steps={len(oracle['steps'])}",
        f"optimizer.lr={h['lr']}",
        "optimizer.warmup_steps=0",
        "optimizer.min_lr_ratio=1.0",
        f"optimizer.b1={h['b1']}",
        f"optimizer.b2={h['b2']}",
        f"optimizer.eps={h['eps']}",
        f"optimizer.weight_decay={h['weight_decay']}",
        f"optimizer.clip_norm={h['clip_norm']}",
    )
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:4])
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        target = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.eval_shape(program.init).params,
            program.state_shardings.params,
        )
        state = program.init_with(load_params(cfg.train.init_from, cfg.model, target))
        got = []
        for batch in oracle["batches"]:
            rows = {k: np.asarray(v, np.float32 if k == "loss_mask" else np.int32) for k, v in batch.items()}
            assert rows["inputs"].shape == (4, 2, 16)
            device_batch = {k: jax.device_put(v, program.batch_sharding) for k, v in rows.items()}
            state, metrics = program.step(state, device_batch)
            got.append(jax.device_get(metrics))
        # the reference is the initial weights, untouched; the policy moved
        reference = jax.device_get(state.reference)
        initial = jax.device_get(load_params(cfg.train.init_from, cfg.model, target))
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(initial)):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(
            jax.tree.leaves(jax.device_get(state.params))[0], jax.tree.leaves(initial)[0]
        )
    np.testing.assert_allclose(float(got[0]["loss"]), math.log(2), rtol=1e-6)
    for step, (want, have) in enumerate(zip(oracle["steps"], got), start=1):
        np.testing.assert_allclose(float(have["loss"]), want["loss"], rtol=1e-5, err_msg=f"step {step}")
        np.testing.assert_allclose(
            float(have["grad_norm"]), want["grad_norm"], rtol=1e-5, err_msg=f"step {step}"
        )
        for key in dpo.METRICS:
            np.testing.assert_allclose(float(have[key]), want[key], atol=1e-5, err_msg=f"step {step} {key}")
        assert float(have["tokens"]) == 4  # every pair counted


# --- preference data ----------------------------------------------------------------------


PLAIN = [
    {"prompt": "The sky is", "chosen": " blue today.", "rejected": " made of cheese."},
    {"prompt": "Two plus two is", "chosen": " four.", "rejected": " five, or so I heard."},
    {"prompt": "Say hello", "chosen": " hello", "rejected": " no"},
]
CHAT = [
    {
        "prompt": [{"role": "user", "content": "Name a colour."}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "I would rather not."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "Let me think about that for a while."}],
    },
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """Token directories from the CLI: plain-string rows and chat-template rows (chatml)."""
    tmp = tmp_path_factory.mktemp("pairs")
    out = {}
    for name, rows in (("plain", PLAIN), ("chat", CHAT)):
        src = _write_jsonl(tmp / f"{name}.jsonl", rows)
        args = parse(src, "--preference", "--tokenizer", CHATML, "--out", tmp / name, "--no-progress")
        assert run_tokenize(args) == 0
        out[name] = str(tmp / name)
    return out


def _window(ids, mask, seq):
    """The pairs iterator's layout of one sequence (token mask 1 on the response), by hand:
    the first seq + 1 tokens, a target counted where its token's mask is 1 (data/pairs.py)."""
    ids, mask = np.asarray(ids)[: seq + 1], np.asarray(mask)[: seq + 1]
    n = ids.size
    row = {k: np.zeros(seq, np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    row["loss_mask"] = np.zeros(seq, np.float32)
    row["inputs"][: min(n, seq)] = ids[:seq]
    row["targets"][: n - 1] = ids[1:]
    row["positions"][: min(n, seq)] = np.arange(min(n, seq))
    row["segment_ids"][: min(n, seq)] = 1
    row["loss_mask"][: n - 1] = mask[1:]
    return row


def _pairs(directory, batch, seq=48):
    cfg = Cfg(paths=(directory,), shuffle=False)
    return make_data_iterator(cfg, vocab_size=512, seq_len=seq, global_batch_size=batch, seed=0, pairs=True)


def test_plain_pairs_are_prompt_response_eos(pair_dirs):
    """Plain rows: tok(prompt) + tok(response) + EOS (tokenizer_config's eos_token, as TRL), the
    loss mask exactly on the response's tokens and EOS; rows in order without shuffling."""
    tok = HFTokenizer(str(CHATML / "tokenizer.json"))
    eos = tok.token_id("<|im_end|>")
    it = _pairs(pair_dirs["plain"], batch=3)
    batch = next(it)
    assert all(v.shape == (3, 2, 48) for v in batch.values())
    for p, row in enumerate(PLAIN):
        prompt = tok.encode_batch([row["prompt"]])[0]
        for which, key in enumerate(("chosen", "rejected")):
            response = tok.encode_batch([row[key]])[0]
            ids = np.concatenate([prompt, response, [eos]])
            want = _window(ids, np.arange(ids.size) >= prompt.size, 48)
            for k, v in want.items():
                np.testing.assert_array_equal(batch[k][p, which], v, err_msg=f"pair {p} {key} {k}")
            assert batch["loss_mask"][p, which].sum() == response.size + 1


def test_chat_pairs_mask_the_response_turn_only(pair_dirs):
    """Chat rows: prompt + response rendered with the template (ids as encode_chat gives them),
    the loss mask on the response turn's generation block only: not on an assistant turn of the
    prompt. Sequences longer than seq_len + 1 are cut at the end."""
    it = _pairs(pair_dirs["chat"], batch=2, seq=64)
    batch = next(it)
    for p, row in enumerate(CHAT):
        for which, key in enumerate(("chosen", "rejected")):
            ids, mask = encode_chat([*row["prompt"], *row[key]], CHATML)
            prompt_ids, prompt_mask = encode_chat(row["prompt"], CHATML)
            assert np.array_equal(ids[: prompt_ids.size], prompt_ids)  # chatml renders the prompt as a prefix
            assert (prompt_mask.sum() > 0) == (p == 1)  # "Hello!<|im_end|>": the prompt's own turn
            mask = mask.copy()
            mask[: prompt_ids.size] = 0  # ... is not trained on; the response's turn is
            assert mask.sum() > 0
            want = _window(ids, mask, 64)
            for k, v in want.items():
                np.testing.assert_array_equal(batch[k][p, which], v, err_msg=f"pair {p} {key} {k}")
    cut = next(_pairs(pair_dirs["chat"], batch=2, seq=16))
    ids, _ = encode_chat([*CHAT[0]["prompt"], *CHAT[0]["chosen"]], CHATML)
    assert ids.size > 17
    np.testing.assert_array_equal(cut["inputs"][0, 0], ids[:16])
    np.testing.assert_array_equal(cut["targets"][0, 0], ids[1:17])


def test_pairs_refused_where_they_do_not_belong(tmp_path, pair_dirs):
    with pytest.raises(DataError, match="train.objective=dpo"):
        make_data_iterator(
            Cfg(paths=(pair_dirs["plain"],)), vocab_size=512, seq_len=16, global_batch_size=2, seed=0
        )
    src = _write_jsonl(tmp_path / "bad.jsonl", [PLAIN[0], {"prompt": "x", "chosen": "y"}])
    assert run_tokenize(parse(src, "--preference", "--tokenizer", CHATML, "--out", tmp_path / "o")) == 2
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "x", "chosen": [], "rejected": "z"}])
    assert run_tokenize(parse(mixed, "--preference", "--tokenizer", CHATML, "--out", tmp_path / "p")) == 2
    for overrides, key in (
        (["train.objective=dpo"], "data.source"),
        (["train.objective=sft"], "train.objective"),
        (["dpo.beta=0"], "dpo.beta"),
        (["dpo.label_smoothing=0.5"], "dpo.label_smoothing"),
        (
            ["train.objective=dpo", "data.source=tokens", "data.paths=[a]", "train.loss_chunk=16"],
            "loss_chunk",
        ),
        (["train.objective=dpo", "data.source=tokens", "data.paths=[a]", "eval.every=2"], "eval.every"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(f"{REPO}/configs/tiny.yaml", overrides)


def test_dpo_training_resumes_with_identical_losses(tmp_path, pair_dirs):
    """`jaxtrain train` on a --preference directory (random init: the reference is the seed's
    weights): killed after the step-2 checkpoint and rerun, steps 3-4 repeat bit for bit; the
    dpo/* metrics are in metrics.jsonl."""
    from jaxtrain.trainer import train

    cfg = tiny_config(
        tmp_path / "run",
        "model.d_model=32",
        "model.mlp_dim=64",
        "model.n_layers=1",
        "train.seq_len=32",
        "train.global_batch_size=2",
        "train.steps=4",
        "train.objective=dpo",
        "dpo.beta=0.2",
        "data.source=tokens",
        f"data.paths=[{pair_dirs['chat']}, {pair_dirs['plain']}]",
        "checkpoint.every=2",
    )
    first = train(cfg, devices=jax.devices()[:1])
    assert abs(first.metrics[0]["loss"] - math.log(2)) < 1e-6
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
    second = train(cfg, devices=jax.devices()[:1])
    assert second.start_step == 2
    keys = ("loss", "grad_norm", *dpo.METRICS)
    want = {r["step"]: tuple(r[k] for k in keys) for r in first.metrics}
    got = {r["step"]: tuple(r[k] for k in keys) for r in second.metrics}
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), (got, want)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(k in records[0] for k in dpo.METRICS)


# --- memory -------------------------------------------------------------------------------


def test_memory_model_and_compiled_step_count_the_reference(tmp_path):
    """The estimate's state grows by one copy of the parameters (per device: over fsdp); the
    compiled step's arguments grow by exactly that copy plus the batch's second sequences."""
    lm = tiny_config(
        tmp_path, "data.source=tokens", "data.paths=[a]", "train.loss_chunk=0", "model.n_layers=1"
    )
    dpo_cfg = replace(lm, train=dict(objective="dpo"))
    params = lm.model.param_count()
    mesh_sizes = {"fsdp": 2}
    diff = estimate(dpo_cfg, mesh_sizes).state - estimate(lm, mesh_sizes).state
    assert abs(diff - params * 4 / 2) <= 1, (diff, params)

    def argument_bytes(cfg):
        mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:1])
        cfg = resolve_for_mesh(cfg, mesh)
        rules = axis_rules(cfg)
        from jaxtrain.recovery.checkpoint import abstract_state
        from jaxtrain.trainer.batches import abstract_batch

        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            program = build_program(cfg, mesh, rules)
            lowered = program.step.lower(abstract_state(program), abstract_batch(cfg, program.batch_sharding))
            return lowered.compile().memory_analysis().argument_size_in_bytes

    batch_fields = 5 * lm.train.global_batch_size * lm.train.seq_len * 4  # int32 / f32 each
    assert argument_bytes(dpo_cfg) - argument_bytes(lm) == params * 4 + batch_fields


def _random_pairs(rng, pairs, seq, vocab):
    """Pair batches in the iterator's layout: a shared prompt, two responses of random lengths."""
    fields = {
        k: np.zeros((pairs, 2, seq), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")
    }
    fields["loss_mask"] = np.zeros((pairs, 2, seq), np.float32)
    for p in range(pairs):
        prompt = rng.integers(0, vocab, size=rng.integers(2, seq // 2))
        for which in range(2):
            response = rng.integers(0, vocab, size=rng.integers(1, seq + 1 - prompt.size))
            ids = np.concatenate([prompt, response])
            mask = np.arange(ids.size) >= prompt.size
            for k, v in _window(ids, mask, seq).items():
                fields[k][p, which] = v
    return fields


@pytest.mark.composes("dpo+tensor", "dpo+context", "dpo+gpipe", "tensor+gpipe", "context+gpipe")
def test_dpo_on_tensor_context_and_pipeline_meshes_equals_one_device(tmp_path):
    """Two DPO steps from the seed's weights give the same losses, gradient norms and rewards
    on a pipeline x context (ring attention, zig-zag order) x tensor mesh, and with two
    microbatches, as on one device in one batch (rtol 1e-5; rewards atol 1e-5). The second
    batch has a pair whose response was cut off: it is left out, and the microbatches then
    count 2 and 1 pairs (means over pairs, not over microbatches)."""
    from jaxtrain.sharding.context import permute_batch

    cfg = tiny_config(
        tmp_path,
        "model.d_model=32",
        "model.mlp_dim=64",
        "train.seq_len=16",
        "train.global_batch_size=4",
        "train.objective=dpo",
        "dpo.label_smoothing=0.1",
        "dpo.beta=0.5",
        "data.source=tokens",
        "data.paths=[unused]",
        "optimizer.warmup_steps=0",
    )
    rng = np.random.default_rng(1)
    batches = [_random_pairs(rng, 4, 16, cfg.model.vocab_size) for _ in range(2)]
    batches[1]["loss_mask"][1, 1] = 0

    def run(microbatches=1, **mesh):
        c = replace(cfg, mesh=mesh, train=dict(microbatches=microbatches))
        n = math.prod(c.mesh.sizes().values())
        m = sharding.make_mesh(c.mesh.sizes(), jax.devices()[:n])
        c = resolve_for_mesh(c, m)
        rules = axis_rules(c)
        with jax.set_mesh(m), sharding.axis_rules(rules):
            program = build_program(c, m, rules)
            state, out = program.init(), []
            for rows in batches:
                rows = permute_batch(rows, c.mesh.context, axis=2)
                batch = {k: jax.device_put(v, program.batch_sharding) for k, v in rows.items()}
                state, metrics = program.step(state, batch)
                out.append(jax.device_get(metrics))
        return out

    want = run()
    assert abs(float(want[0]["loss"]) - math.log(2)) < 1e-6
    assert [float(m["tokens"]) for m in want] == [4, 3]  # counted pairs
    for mesh in (dict(stage=2, context=2, tensor=2), dict(microbatches=2)):
        for step, (w, g) in enumerate(zip(want, run(**mesh)), start=1):
            for key in ("loss", "grad_norm"):
                np.testing.assert_allclose(
                    float(g[key]), float(w[key]), rtol=1e-5, err_msg=f"{mesh} {step} {key}"
                )
            for key in dpo.METRICS:
                np.testing.assert_allclose(
                    float(g[key]), float(w[key]), atol=1e-5, err_msg=f"{mesh} {step} {key}"
                )


@pytest.mark.composes("dpo+lora")
def test_dpo_with_lora_takes_the_base_as_its_reference(tmp_path, oracle):
    """DPO on adapters (the PEFT asset's, B non-zero, so the policy starts away from the base):
    the state keeps no reference copy, and step 1's loss and rewards equal those of two plain
    models through the LM path, no adapter code: the adapters merged into the weights (the
    policy) and the base alone (the reference)."""
    from tests.test_lora import BASE, LORA, lora_config, on_mesh

    h = oracle["hparams"]
    hf_to_ckpt(BASE, tmp_path / "base")
    cfg = lora_config(
        tmp_path,
        tmp_path / "base",
        "train.objective=dpo",
        f"dpo.beta={h['beta']}",
        "data.source=tokens",
        "data.paths=[unused]",
        "train.global_batch_size=4",
        "train.steps=1",
    )
    assert cfg.model.lora.init_from == str(LORA / "initial")
    cfg, mesh, rules = on_mesh(cfg)
    rows = {
        k: np.asarray(v, np.float32 if k == "loss_mask" else np.int32)
        for k, v in oracle["batches"][0].items()
    }
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        state = initial_state(cfg, program, abstract_state(program), lambda _: None)
        assert state.reference is None and state.frozen is not None
        whole = jax.device_get(lora.join(state.frozen, state.params))
        _, metrics = program.step(
            state, {k: jax.device_put(v, program.batch_sharding) for k, v in rows.items()}
        )
        metrics = jax.device_get(metrics)
    plain = models.ModelConfig(**{**cfg.model.__dict__, "lora": None})
    g, abstract = models.abstract_model(lambda: models.Transformer(plain, rngs=nnx.Rngs(0)))
    base, _ = lora.split(whole)

    def logps(params):
        model = models.merge(g, abstract, params)
        return dpo.pair_logps(model, rows, None, packs_documents=True, pipeline=None)[0]

    total, count, sums = dpo.dpo_sums(
        logps(lora.merged(whole, cfg.model)),
        logps(base),
        dpo.counted_pairs(rows["loss_mask"]),
        beta=h["beta"],
        label_smoothing=0.0,
    )
    assert abs(float(metrics["loss"]) - math.log(2)) > 1e-3  # the adapters already matter
    np.testing.assert_allclose(float(metrics["loss"]), float(total / count), rtol=1e-5)
    for key in dpo.METRICS:
        np.testing.assert_allclose(float(metrics[key]), float(sums[key] / count), atol=1e-5, err_msg=key)
