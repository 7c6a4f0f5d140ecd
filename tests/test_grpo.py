"""GRPO (train.objective=grpo): TRL's advantages, loss aggregations and clipping against
hand-computed cases; the prompts loader and the rewards; an end-to-end CLI run."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxtrain.trainer import grpo
from tests.conftest import REPO

ASSETS = Path(__file__).parent / "assets"
CHATML = ASSETS / "chat" / "chatml"

# --- advantages -----------------------------------------------------------------------------


def test_advantages_scale_rewards_by_hand():
    # two groups of 3: [1, 2, 3] (mean 2, std with n-1 = 1) and [0, 0, 3] (mean 1, std sqrt(3))
    r = [1.0, 2.0, 3.0, 0.0, 0.0, 3.0]
    none = grpo.advantages(r, 3, "none")
    np.testing.assert_allclose(none, [-1, 0, 1, -1, -1, 2], atol=0)
    group = grpo.advantages(r, 3, "group")
    s = math.sqrt(3.0)
    np.testing.assert_allclose(
        group, [-1 / 1.0001, 0, 1 / 1.0001, -1 / (s + 1e-4), -1 / (s + 1e-4), 2 / (s + 1e-4)], rtol=1e-6
    )
    # batch: std over all six with n-1: mean 1.5, squares 0.25+0.25+2.25+2.25+2.25+2.25 = 9.5 -> var 1.9
    batch = grpo.advantages(r, 3, "batch")
    np.testing.assert_allclose(batch, np.array([-1, 0, 1, -1, -1, 2]) / (math.sqrt(1.9) + 1e-4), rtol=1e-6)
    # a group of equal rewards has zero advantage, not a division by zero
    np.testing.assert_array_equal(grpo.advantages([2.0, 2.0], 2, "group"), [0.0, 0.0])


# --- aggregation ---------------------------------------------------------------------------

# Two completions: row 0 has 2 completion tokens with per-token losses (a, b); row 1 has 1 (c).
_MASK = np.array([[0, 1, 1, 0], [0, 0, 1, 0]], np.float32)
_LOSS = np.array([[9.0, 1.0, 3.0, 9.0], [9.0, 9.0, 5.0, 9.0]], np.float32)  # 9: not counted


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((1 + 3) / 2 + 5 / 1) / 2),  # mean over completions of the token means: 3.5
        ("bnpo", (1 + 3 + 5) / 3),  # token sum / completion tokens
        ("dapo", (1 + 3 + 5) / 3),
        ("dr_grpo", (1 + 3 + 5) / (2 * 4)),  # / (completions x max_new_tokens=4)
    ],
)
def test_loss_type_normalisers_by_hand(loss_type, expected):
    weight, share = grpo.loss_weights(_MASK, loss_type, max_new_tokens=4)
    assert float(np.sum(weight * _LOSS)) == pytest.approx(expected, rel=1e-6)
    assert float(np.sum(share)) == pytest.approx(1.0, rel=1e-6)


def test_normaliser_is_global_whatever_the_split():
    """The weights of the whole batch, summed over any row split, give the whole batch's loss."""
    rng = np.random.default_rng(0)
    mask = (rng.random((8, 6)) < 0.6).astype(np.float32)
    loss = rng.normal(size=(8, 6)).astype(np.float32)
    for loss_type in grpo.LOSS_TYPES:
        w, _ = grpo.loss_weights(mask, loss_type, 6)
        whole = np.sum(w * loss)
        halves = np.sum(w[::2] * loss[::2]) + np.sum(w[1::2] * loss[1::2])
        assert halves == pytest.approx(whole, rel=1e-6, abs=1e-7)


def test_bnpo_normalises_each_microbatch_by_its_own_tokens():
    """TRL 1.16's bnpo: each accumulation step's loss is its token sum / its own completion
    tokens, divided by the steps. Four rows in train.microbatches=2 (microbatch m: rows m,
    m + 2): rows 0, 2 hold losses (1, 3) and (2): 6 / 3 = 2; rows 1, 3 hold (5) and (4, 6, 8):
    23 / 4 = 5.75; bnpo = (2 + 5.75) / 2 = 3.875, where dapo (the whole batch's tokens) is
    29 / 7. With one microbatch bnpo is dapo."""
    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 1]], np.float32)
    loss = np.array([[1, 3, 9], [5, 9, 9], [2, 9, 9], [4, 6, 8]], np.float32)  # 9: not counted
    bnpo, share = grpo.loss_weights(mask, "bnpo", 3, microbatches=2)
    assert float(np.sum(bnpo * loss)) == pytest.approx(3.875, rel=1e-6)
    assert float(np.sum(share)) == pytest.approx(1.0, rel=1e-6)  # metrics: the batch's token mean
    dapo, _ = grpo.loss_weights(mask, "dapo", 3, microbatches=2)
    assert float(np.sum(dapo * loss)) == pytest.approx(29 / 7, rel=1e-6)
    one, _ = grpo.loss_weights(mask, "bnpo", 3, microbatches=1)
    assert float(np.sum(one * loss)) == pytest.approx(29 / 7, rel=1e-6)


def test_reward_std_is_the_whole_batchs_as_trl_logs_it():
    """TRL 1.16 logs nanstd(rewards): the std of the whole batch's rewards with n - 1, NaNs
    left out, whatever scale_rewards. Rewards [1, 2, 3, 0, 0, 3] in groups of 3: mean 1.5,
    squares 9.5, var 9.5 / 5 = 1.9 -> 1.3784 (the mean of the groups' stds, 1 and sqrt(3),
    would be 1.3660)."""
    assert grpo.reward_std([1.0, 2.0, 3.0, 0.0, 0.0, 3.0]) == pytest.approx(math.sqrt(1.9), rel=1e-12)
    assert grpo.reward_std([1.0, float("nan"), 3.0]) == pytest.approx(math.sqrt(2.0), rel=1e-12)


# --- the clipped objective and the KL -------------------------------------------------------


def _terms(logp, old, ref, adv, **kw):
    f = lambda x: jnp.asarray([[x]], jnp.float32)
    args = {"epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.0, **kw}
    loss, kl, region = grpo.per_token_terms(f(logp), f(old), f(ref), f(adv), **args)
    return float(loss[0, 0]), (None if kl is None else float(kl[0, 0])), float(region[0, 0])


def test_clipping_and_kl_by_hand():
    # ratio = e^0.5 = 1.6487 > 1.2; A = 2 > 0: the clipped term 1.2 * 2 is the smaller -> loss -2.4
    loss, kl, region = _terms(0.5, 0.0, 0.0, 2.0)
    assert loss == pytest.approx(-2.4, rel=1e-6) and kl is None and region == 1.0
    # same ratio, A = -2: min(-3.2974, -2.4) = -3.2974 (unclipped) -> loss 3.2974, not in the region
    loss, _, region = _terms(0.5, 0.0, 0.0, -2.0)
    assert loss == pytest.approx(2.0 * math.exp(0.5), rel=1e-6) and region == 0.0
    # ratio e^-0.5 = 0.6065 < 0.8 with A = -1: clipped 0.8 * -1 -> loss 0.8, in the region
    loss, _, region = _terms(-0.5, 0.0, 0.0, -1.0)
    assert loss == pytest.approx(0.8, rel=1e-6) and region == 1.0
    # epsilon_high: ratio e^0.5 with epsilon_high 0.28 -> clipped at 1.28
    loss, _, _ = _terms(0.5, 0.0, 0.0, 1.0, epsilon_high=0.28)
    assert loss == pytest.approx(-1.28, rel=1e-6)
    # k3 KL: ref - logp = -0.3 -> e^-0.3 + 0.3 - 1 = 0.040818; beta 0.1 added to the ratio term
    loss, kl, _ = _terms(0.3, 0.3, 0.0, 1.0, beta=0.1)
    k3 = math.exp(-0.3) + 0.3 - 1.0
    assert kl == pytest.approx(k3, rel=1e-5)
    assert loss == pytest.approx(-1.0 + 0.1 * k3, rel=1e-5)


def test_token_logps_are_of_the_tempered_softmax():
    logits = jnp.asarray([[[1.0, 2.0, 0.5]]], jnp.float32)
    got = float(grpo.token_logps(logits, jnp.asarray([[1]]), 0.7)[0, 0])
    z = np.array([1.0, 2.0, 0.5]) / 0.7
    assert got == pytest.approx(z[1] - np.log(np.exp(z).sum()), rel=1e-6)


# --- prompts and rewards --------------------------------------------------------------------


def test_prompts_render_truncate_and_follow_the_seed(tmp_path):
    from jaxtrain.data.chat import ChatEncoder
    from jaxtrain.data.prompts import PromptIterator

    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "hello there", "answer": 1},
        {"messages": [{"role": "user", "content": "hi"}], "answer": 2},
    ]
    rows += [{"prompt": f"row {i}", "answer": i} for i in range(3, 8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = types.SimpleNamespace(paths=(str(path),), tokenizer=str(CHATML), shuffle=True)
    it = PromptIterator(data, max_prompt_len=4, global_batch_size=3, seed=5)
    enc = ChatEncoder(str(CHATML), mask_by_role=True)
    chat_text = enc.render(rows[1]["messages"], add_generation_prompt=True)[0]
    assert chat_text.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert it.rows[1].text == chat_text and it.rows[1].fields == {"answer": 2}
    full = enc.tokenizer.encode_batch([chat_text])[0]
    assert it.rows[1].ids.tolist() == full[-4:].tolist()  # cut from the left
    assert it.truncated == sum(len(i) > 4 for i in enc.tokenizer.encode_batch([r.text for r in it.rows]))
    # batch k: a pure function of (seed, k); two epochs of 7 rows each hold every row once
    first = [r.index for k in range(5) for r in it.batch_at(k)][:14]
    assert sorted(first[:7]) == list(range(7)) and sorted(first[7:]) == list(range(7))
    it2 = PromptIterator(data, max_prompt_len=4, global_batch_size=3, seed=5)
    it2.set_state({"source": "prompts", "batch": 3})
    assert [r.index for r in next(it2)] == [r.index for r in it.batch_at(3)]


def test_rewards_weighted_sum_none_left_out_and_one_line_errors(tmp_path, monkeypatch):
    from jaxtrain.trainer.rewards import RewardError, load_rewards, score

    (tmp_path / "rw.py").write_text(
        "def a(prompts, completions, completion_ids, answer, **kw):\n"
        "    return [float(len(c)) for c in completions]\n"
        "def b(prompts, completions, completion_ids, **kw):\n"
        "    return [None, 2.0]\n"
        "def short(prompts, completions, **kw):\n"
        "    return [1.0]\n"
        "def boom(prompts, completions, **kw):\n"
        "    raise KeyError('x')\n"
        "def text(prompts, completions, **kw):\n"
        "    return ['1', '2']\n"
    )
    monkeypatch.chdir(tmp_path)
    fns = load_rewards(["rw:a", "rw:b"])
    table, total = score(fns, (0.5, 2.0), ["p", "q"], ["ab", "c"], [[1], [2]], {"answer": [1, 2]})
    np.testing.assert_array_equal(total, [1.0, 0.5 + 4.0])  # None left out of the first sum
    assert np.isnan(table[0, 1])
    for name, fragment in [
        ("short", "returned 1 values for 2"),
        ("boom", "raised KeyError"),
        ("text", "'1'"),
    ]:
        with pytest.raises(RewardError, match=f"reward rw:{name} .*{fragment}"):
            score(load_rewards([f"rw:{name}"]), (), ["p", "q"], ["a", "b"], [[1], [2]], {})
    with pytest.raises(RewardError, match="grpo.rewards 'rw:nope'"):
        load_rewards(["rw:nope"])


# --- end to end: `jaxtrain train` with train.objective=grpo -----------------------------------

REWARD_MODULE = '''
def count_a(prompts, completions, completion_ids, target, **kw):
    return [float(c.count(t)) for c, t in zip(completions, target)]

def short(prompts, completions, completion_ids, **kw):
    return [None if i % 2 else -0.05 * len(c) for i, c in enumerate(completion_ids)]
'''
PROMPTS = [
    {"prompt": "hello", "target": "a"},
    {"messages": [{"role": "user", "content": "say a"}], "target": "a"},
    {"prompt": "abc abc abc abc abc abc abc", "target": "b"},
    {"prompt": "xyz", "target": "c"},
]
E2E_STEPS, E2E_EVERY = 6, 3  # rollouts at steps 1, 3, 5 (updates_per_rollout=2): 3 is mid-rollout


@pytest.fixture(scope="module")
def grpo_setup(tmp_path_factory):
    """A converted tiny Llama whose vocab holds chatml's 303 ids, the prompts, the reward module."""
    from tests.test_post_training_kill import setup as post_training_setup

    tmp = post_training_setup.__wrapped__(tmp_path_factory)
    (tmp / "grpo_rewards.py").write_text(REWARD_MODULE)
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return tmp


def _grpo_command(setup, out_dir, *extra):
    return [
        sys.executable,
        "-m",
        "jaxtrain",
        "train",
        str(setup / "config.yaml"),
        f"output_dir={out_dir}",
        f"train.init_from={setup / 'base'}",
        "train.objective=grpo",
        "data.source=prompts",
        f"data.paths=[{setup / 'prompts.jsonl'}]",
        f"data.tokenizer={CHATML}",
        "grpo.rewards=[grpo_rewards:count_a,grpo_rewards:short]",
        "grpo.reward_weights=[1.0,2.0]",
        "grpo.group_size=4",
        "grpo.max_new_tokens=8",
        "grpo.max_prompt_len=12",
        "grpo.temperature=0.9",
        "grpo.top_k=50",
        "grpo.beta=0.05",
        "grpo.updates_per_rollout=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "train.global_batch_size=8",
        "train.seq_len=24",
        f"train.steps={E2E_STEPS}",
        f"checkpoint.every={E2E_EVERY}",
        "logging.progress=false",
        "logging.tensorboard=false",
        *extra,
    ]


def _start(setup, out_dir):
    from tests.test_checkpoint_kill import env

    e = env()
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(setup), str(REPO), e.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        _grpo_command(setup, out_dir),
        cwd=setup,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def grpo_run(grpo_setup):
    from tests.test_checkpoint_kill import finish

    out = grpo_setup / "uninterrupted"
    code, stdout, err = finish(_start(grpo_setup, out))
    assert code == 0, err[-3000:]
    return out, stdout + err


def _rollouts(out_dir):
    return [json.loads(line) for line in (out_dir / "rollouts.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_cli_run_records_rollouts_and_metrics(grpo_run):
    out, stdout = grpo_run
    assert "generation refuses mesh.stage > 1" in stdout and "longer than grpo.max_prompt_len" in stdout
    rows = _rollouts(out)
    assert [r["step"] for r in rows] == [1] * 8 + [3] * 8 + [5] * 8  # reused for two steps each
    for r in rows:
        assert set(r) == {
            "step", "prompt_index", "prompt_ids", "completion_ids", "completion", "rewards", "reward",
            "advantage", "old_logprobs", "truncated",
        }  # fmt: skip
        assert len(r["old_logprobs"]) == len(r["completion_ids"]) and len(r["prompt_ids"]) <= 12
        ends_at_eos = r["completion_ids"][-1] == 300  # chatml's <|endoftext|>
        assert r["truncated"] == (not ends_at_eos) and (ends_at_eos or len(r["completion_ids"]) == 8)
        parts = r["rewards"]
        want = parts["grpo_rewards:count_a"] + 2.0 * (parts["grpo_rewards:short"] or 0.0)
        assert r["reward"] == pytest.approx(want, rel=1e-6)
    for first in range(0, 24, 4):  # group advantages: (r - mean) / (std(n-1) + 1e-4)
        group = rows[first : first + 4]
        assert len({r["prompt_index"] for r in group}) == 1
        want = grpo.advantages([r["reward"] for r in group], 4, "group")
        np.testing.assert_allclose([r["advantage"] for r in group], want, rtol=1e-5, atol=1e-6)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, E2E_STEPS + 1))
    for m in metrics:
        for key in ("grpo/reward", "grpo/reward_std", "grpo/kl", "grpo/clip_ratio", "grpo/completion_length"):
            assert np.isfinite(m[key]), key
        assert m["grpo/sample_tokens_per_second"] > 0
    step1 = [r for r in rows if r["step"] == 1]
    assert metrics[0]["grpo/reward"] == pytest.approx(np.mean([r["reward"] for r in step1]), rel=1e-5)
    # TRL's reward_std: the whole batch's (n - 1), not the mean of the groups'
    want_std = np.std([r["reward"] for r in step1], ddof=1)
    assert metrics[0]["grpo/reward_std"] == pytest.approx(want_std, rel=1e-5, abs=1e-7)
    assert metrics[0]["grpo/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference
    goodput = json.loads((out / "goodput.json").read_text())
    assert goodput["seconds"]["sample"] > 0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")
def test_grpo_kill_9_inside_a_reused_rollout_then_rerun_is_bit_identical(tmp_path, grpo_setup, grpo_run):
    """Killed after the checkpoint at step 3 (the middle of the rollout sampled for step 3):
    the rerun takes that rollout back and its sampler keys follow from the step, so every
    logged step and the final weights equal the uninterrupted run's bit for bit."""
    from tests.test_checkpoint_kill import finalized_steps, finish, records, wait_for
    from tests.test_post_training_kill import flatten

    ref_dir, _ = grpo_run
    run_dir = tmp_path / "killed"
    compared = ("loss", "grad_norm", "lr", "grpo/reward", "grpo/kl", "grpo/clip_ratio")
    reference = {r["step"]: tuple(r[k] for k in compared) for r in records(ref_dir)}
    proc = _start(grpo_setup, run_dir)
    wait_for(lambda: finalized_steps(run_dir / "checkpoints"), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    code, out, err = finish(_start(grpo_setup, run_dir))
    assert code == 0, err[-3000:]
    assert "resumed from" in out + err and "rollout 1 (in use at the checkpoint) read back" in err
    rows = records(run_dir)
    assert {r["step"] for r in rows} == set(range(1, E2E_STEPS + 1))
    for r in rows:
        assert tuple(r[k] for k in compared) == reference[r["step"]], (r, reference[r["step"]])
    assert _rollouts(run_dir) == _rollouts(ref_dir)  # each rollout once, sampled alike

    def final(out_dir):
        state = ocp.PyTreeCheckpointer().restore(
            os.path.join(out_dir, "checkpoints", str(E2E_STEPS), "state")
        )
        return flatten({k: state[k] for k in ("params", "opt_state")})

    want, got = final(ref_dir), final(run_dir)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# --- the sampler: the tempered policy, and the old log-probs it records ----------------------


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "deltanet"])
def test_sampled_tokens_follow_the_tempered_policy(hybrid):
    """Over 2048 sampled tokens, the mean negative log-prob of what was drawn (under
    softmax(logits / T) of the full forward) equals the mean entropy of those distributions:
    E[-log p(x)] = H(p) when x ~ p. The gap is tested against 4 standard errors of the
    per-token differences; sampling at a different temperature (T' = 0.5 while the check
    uses 1.0) is caught by the same test, so the check can fail. `deltanet`: Qwen3.5's layers,
    the rollout's decode carrying their conv window and state (GRPO's sampler on a hybrid)."""
    from flax import nnx

    from jaxtrain import models
    from jaxtrain.models import generation

    cfg = models.ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64, init_std=0.2
    )
    if hybrid:
        cfg = dataclasses.replace(
            cfg,
            layer_types=("linear_attention", "full_attention"),
            linear_attention=models.LinearAttentionConfig(
                num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8
            ),
            attention_output_gate=True,
            partial_rotary_factor=0.5,
            qk_norm="head",
        )
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    rows, prompt, new = 128, 4, 16
    tokens = np.random.default_rng(1).integers(0, 61, (rows, prompt)).astype(np.int32)
    lengths = np.full((rows,), prompt, np.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def sample(temperature, key):
        return generation.generate_traced(
            model, jnp.asarray(tokens), jnp.asarray(lengths), key, max_new_tokens=new, temperature=temperature
        )

    def gap(sampled_at, judged_at):
        out = sample(sampled_at, jax.random.key(3))
        logits = model(out[:, :-1]).astype(jnp.float32) / judged_at
        logp = jax.nn.log_softmax(logits[:, prompt - 1 :], axis=-1)
        drawn = out[:, prompt:]
        nll = -jnp.take_along_axis(logp, drawn[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        d = np.asarray(nll - entropy).ravel()
        return d.mean() / (d.std(ddof=1) / np.sqrt(d.size))

    assert abs(gap(0.7, 0.7)) < 4.0
    assert abs(gap(0.5, 1.0)) > 4.0  # the wrong temperature is seen


@pytest.mark.slow
def test_old_logprobs_are_the_sampling_policys(grpo_setup, grpo_run):
    """The first rollout was sampled with the converted base: its old_logprobs equal the
    log-probs of the completion tokens under softmax(logits / 0.9) of that model's full
    forward over prompt + completion, within 1e-5 (f32; we see ~1e-6)."""
    from flax import nnx

    from jaxtrain import models
    from jaxtrain.config import load_config
    from jaxtrain.interchange.convert import load_params

    out, _ = grpo_run
    cfg = load_config(out / "config.yaml")
    graphdef, abstract = models.abstract_model(lambda: models.Transformer(cfg.model, rngs=nnx.Rngs(0)))
    params = load_params(str(grpo_setup / "base"), cfg.model, nnx.to_pure_dict(abstract))
    model = models.merge(graphdef, abstract, params)
    for r in [r for r in _rollouts(out) if r["step"] == 1]:
        ids = jnp.asarray([r["prompt_ids"] + r["completion_ids"]], jnp.int32)
        logits = model(ids[:, :-1]).astype(jnp.float32)[0, len(r["prompt_ids"]) - 1 :] / 0.9
        want = jax.nn.log_softmax(logits, axis=-1)[
            jnp.arange(len(r["completion_ids"])), ids[0, len(r["prompt_ids"]) :]
        ]
        np.testing.assert_allclose(r["old_logprobs"], np.asarray(want), atol=1e-5)


# --- against a plain torch GRPO loop (tests/assets/make_grpo_assets.py) ---------------------


def _oracle_overrides(oracle) -> list[str]:
    """The config of the torch loop's run: its GRPO and AdamW settings, 8 completions of 16."""
    h = oracle["hparams"]
    return [
        "train.objective=grpo",
        "data.source=prompts",
        f"data.tokenizer={CHATML}",
        "grpo.rewards=[unused:reward]",
        f"grpo.group_size={oracle['group_size']}",
        "grpo.max_new_tokens=8",
        f"grpo.temperature={h['temperature']}",
        f"grpo.epsilon={h['epsilon']}",
        f"grpo.epsilon_high={h['epsilon_high']}",
        f"grpo.beta={h['beta']}",
        f"grpo.loss_type={h['loss_type']}",
        f"grpo.updates_per_rollout={oracle['updates_per_rollout']}",
        "train.global_batch_size=8",
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
    ]


def _train_on_oracle_rollouts(cfg, oracle, devices: int = 4):
    """(each step's metrics, the final params, (mesh, rules, params target)) of jaxtrain's GRPO
    step on the oracle's rollouts from cfg's train.init_from. old_logps are the weights' own
    log-probs when each rollout is first used, as the sampler records them."""
    from jaxtrain import models, sharding
    from jaxtrain.interchange.convert import load_params
    from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
    from jaxtrain.trainer.program import build_program

    h, group, seq = oracle["hparams"], oracle["group_size"], cfg.train.seq_len
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:devices])
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    spec = types.SimpleNamespace(cfg=cfg, pipeline=None)
    got = []
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        target = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.eval_shape(program.init).params,
            program.state_shardings.params,
        )
        state = program.init_with(load_params(cfg.train.init_from, cfg.model, target))

        @jax.jit
        def old_logps(params, batch):
            model = models.merge(program.graphdef, program.abstract_params, params)
            return grpo.policy_logps(model, batch, None, spec)[0]

        for rollout in oracle["rollouts"]:
            rewards = np.asarray(rollout["rewards"], np.float32)
            rows = {
                k: np.asarray(v, np.float32 if k == "loss_mask" else np.int32)
                for k, v in rollout.items()
                if k != "rewards"
            }
            weight, share = grpo.loss_weights(
                rows["loss_mask"], h["loss_type"], cfg.grpo.max_new_tokens, cfg.train.microbatches
            )
            adv = grpo.advantages(rewards, group, h["scale_rewards"])
            rows.update(
                advantages=np.repeat(adv[:, None], seq, axis=1), loss_weight=weight, token_share=share
            )
            place = lambda r: {k: jax.device_put(v, program.batch_sharding) for k, v in r.items()}
            rows["old_logps"] = np.asarray(old_logps(state.params, place(rows))) * rows["loss_mask"]
            batch = place(rows)
            for _ in range(oracle["updates_per_rollout"]):
                state, metrics = program.step(state, batch)
                got.append(jax.device_get(metrics))
        final = jax.device_get(state.params)
    return got, final, (mesh, rules, target)


def _assert_final_weights(tmp_path, cfg, final, where, hf_config, oracle_dir, steps, atol=1e-5):
    """`final` equals the torch loop's final weights (oracle_dir/final.safetensors, HF names),
    converted as the initial ones were, within `atol` (f32), but for Adam's few elements at
    rounding level (tests.conftest.assert_adam_weights_close), within the steps' learning rates."""
    import shutil

    from jaxtrain import sharding
    from jaxtrain.interchange.convert import hf_to_ckpt, load_params

    mesh, rules, target = where
    hf_final = tmp_path / "hf_final"
    hf_final.mkdir()
    shutil.copy(hf_config, hf_final / "config.json")
    shutil.copy(oracle_dir / "final.safetensors", hf_final / "model.safetensors")
    hf_to_ckpt(hf_final, tmp_path / "final_ckpt")
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        want_final = jax.device_get(load_params(str(tmp_path / "final_ckpt"), cfg.model, target))
    from tests.conftest import assert_adam_weights_close

    # seen: one element of one layer's k_proj 1.6e-5 away (microbatches=2, an AMD EPYC host)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(final), jax.tree.leaves(want_final)):
        assert_adam_weights_close(
            a, b, atol=atol, step_bound=cfg.optimizer.lr * steps, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.composes("grpo+dense", "grpo+data", "grpo+fsdp", "grpo+adamw")
@pytest.mark.parametrize("microbatches", [1, 2])
def test_grpo_steps_and_weights_equal_torch_on_a_data_fsdp_mesh(tmp_path, microbatches):
    """Two rollouts, each trained on for two steps (updates_per_rollout=2), from the tiny HF
    Llama's weights on data=2 x fsdp=2 (and in two microbatches: the normalisers are the
    global batch's), loss_type=grpo, beta=0.1, epsilon 0.03 / epsilon_high 0.05 (most tokens
    clipped in the reused steps): every step's loss, gradient norm, KL and clip ratio equal the
    torch loop's within rtol 1e-5 (atol 1e-6), and the final weights within 1e-5 (f32).
    old_logps are the weights' own log-probs when each rollout is first used, as the sampler
    records them."""
    import gzip

    from tests.test_dpo import _hf_config

    with gzip.open(ASSETS / "grpo" / "expected.json.gz", "rt") as f:
        oracle = json.load(f)
    cfg = _hf_config(
        tmp_path,
        *_oracle_overrides(oracle),
        "mesh.data=2",
        "mesh.fsdp=2",
        f"train.microbatches={microbatches}",
    )
    got, final, where = _train_on_oracle_rollouts(cfg, oracle)
    for step, (want, have) in enumerate(zip(oracle["steps"], got), start=1):
        for key in ("loss", "grad_norm", "grpo/kl", "grpo/clip_ratio"):
            np.testing.assert_allclose(
                float(have[key]), want[key], rtol=1e-5, atol=1e-6, err_msg=f"step {step} {key}"
            )
    hf_config = ASSETS / "hf" / "llama_gqa_rope_llama3" / "config.json"
    _assert_final_weights(tmp_path, cfg, final, where, hf_config, ASSETS / "grpo", len(got))


@pytest.mark.composes("grpo+moe", "moe+adamw", "grpo+qk_norm", "qk_norm+data", "qk_norm+adamw")
def test_grpo_on_moe_adds_the_router_loss_as_trl_does(tmp_path):
    """GRPO on the tiny HF Qwen3-MoE cut to one layer (router_aux_loss_coef 0.05), data=2 x
    fsdp=2 in two microbatches, against the torch loop of tests/assets/make_grpo_moe_assets.py:
    TRL 1.16 adds ``router_aux_loss_coef x aux_loss`` of each microbatch (divided by the
    accumulation steps) beside the policy loss, not scaled by the completion-token count.
    Every step's loss, gradient norm and aux loss (ours x top_k: HF sums over the k choices)
    within rtol 1e-5 (atol 1e-6), the final weights within 2e-5 (f32). HF has no z-loss, nor
    has the converted model. One layer and unpadded rows: HF pools the layers'
    router statistics and leaves padding out of them (make_grpo_moe_assets.py)."""
    import dataclasses
    import gzip

    from jaxtrain.interchange.convert import hf_to_ckpt
    from tests.conftest import tiny_config

    oracle_dir = ASSETS / "grpo_moe"
    with gzip.open(oracle_dir / "expected.json.gz", "rt") as f:
        oracle = json.load(f)
    h = oracle["hparams"]
    hf_dir = tmp_path / "hf"
    _one_layer_model(ASSETS / oracle["source"], hf_dir, h["router_aux_loss_coef"])
    model_cfg = hf_to_ckpt(hf_dir, tmp_path / "ckpt")
    assert model_cfg.moe.z_loss_weight == 0.0  # transformers adds none
    model = [
        f"model.{k}={v}"
        for k, v in dataclasses.asdict(model_cfg).items()
        if v not in (None, ()) and not isinstance(v, dict)
    ]
    cfg = tiny_config(
        tmp_path,
        *model,
        f"model.moe={json.dumps(dataclasses.asdict(model_cfg.moe))}",
        "data.paths=[unused]",
        f"train.init_from={tmp_path / 'ckpt'}",
        *_oracle_overrides(oracle),
        "mesh.data=2",
        "mesh.fsdp=2",
        f"train.microbatches={h['microbatches']}",
    )
    assert cfg.model.moe.aux_loss_weight == pytest.approx(h["router_aux_loss_coef"] * cfg.model.moe.top_k)
    got, final, where = _train_on_oracle_rollouts(cfg, oracle)
    for step, (want, have) in enumerate(zip(oracle["steps"], got), start=1):
        pairs = [("loss", "loss"), ("grad_norm", "grad_norm"), ("aux_loss", "moe_aux_loss")]
        for key, ours in pairs:
            value = float(have[ours]) * (cfg.model.moe.top_k if key == "aux_loss" else 1)
            np.testing.assert_allclose(value, want[key], rtol=1e-5, atol=1e-6, err_msg=f"step {step} {key}")
    # atol 2e-5: one expert weight of 8192 ends 1.2e-5 away (Adam's step on a near-zero
    # gradient magnifies float32 noise); every other weight, the router's included, < 1e-6
    hf_config = hf_dir / "config.json"
    _assert_final_weights(tmp_path, cfg, final, where, hf_config, oracle_dir, len(got), atol=2e-5)


def _one_layer_model(source, dest, coef: float) -> None:
    """tests/assets/make_grpo_moe_assets.py `one_layer_model`: the HF Qwen3-MoE `source` cut
    to its first layer, with router_aux_loss_coef `coef`, written to `dest`."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    config.update(num_hidden_layers=1, router_aux_loss_coef=coef)
    weights = load_file(source / "model.safetensors")
    kept = {k: v for k, v in weights.items() if ".layers." not in k or ".layers.0." in k}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, dest / "model.safetensors")


def test_grpo_config_refusals_name_the_key(tmp_path):
    from jaxtrain.config import ConfigError
    from tests.conftest import tiny_config

    ok = [
        "train.objective=grpo",
        "data.source=prompts",
        "data.paths=[p.jsonl]",
        "grpo.rewards=[m:f]",
        "grpo.group_size=4",
        "grpo.max_new_tokens=16",
    ]
    cfg = tiny_config(tmp_path, *ok)
    assert cfg.grpo.prompt_len(cfg.train.seq_len) == 128 - 16  # the default: seq_len - max_new_tokens
    for extra, message in [
        (["mesh.stage=2"], "mesh.stage=2 with train.objective=grpo: the sampler does not run pipeline"),
        (
            ["mesh.context=2"],
            "mesh.context=2 with train.objective=grpo: rollouts are not laid out in the zig-zag",
        ),
        (
            ["train.global_batch_size=6"],
            "train.global_batch_size=6: expected a multiple of grpo.group_size=4",
        ),
        (["grpo.reward_weights=[1.0,2.0]"], r"grpo.reward_weights=\[1.0, 2.0\]: expected one weight per"),
        (["grpo.rewards=[nofunction]"], "grpo.rewards entry 'nofunction': expected module:function"),
        (["data.source=tokens"], "train.objective=grpo with data.source='tokens'"),
        (["grpo.max_prompt_len=120"], r"grpo.max_prompt_len=120 \+ grpo.max_new_tokens=16"),
        (["grpo.loss_type=ppo"], "grpo.loss_type='ppo': expected grpo, bnpo, dr_grpo or dapo"),
        (["grpo.scale_rewards=std"], "grpo.scale_rewards='std'"),
        (["grpo.top_p=0"], r"grpo.top_p=0.0: expected a number in \(0, 1\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            tiny_config(tmp_path, *ok, *extra)
    with pytest.raises(ConfigError, match="data.source=prompts with train.objective='lm'"):
        tiny_config(tmp_path, "data.source=prompts", "data.paths=[p.jsonl]")


@pytest.mark.composes("grpo+lora")
def test_grpo_with_lora_takes_the_base_as_its_reference(tmp_path):
    """GRPO on adapters (the PEFT asset's, B non-zero: the policy starts away from the base)
    with beta=0.1: the state keeps no reference copy, and step 1's KL and loss equal those
    of two plain models run without adapter code: the adapters merged into the weights (the
    policy) and the base alone (the reference); rtol 1e-5."""
    import gzip

    from flax import nnx

    from jaxtrain import models, sharding
    from jaxtrain.interchange.convert import hf_to_ckpt
    from jaxtrain.models import lora
    from jaxtrain.recovery.checkpoint import abstract_state
    from jaxtrain.trainer.loop import initial_state
    from jaxtrain.trainer.program import build_program
    from tests.test_lora import BASE, lora_config, on_mesh

    with gzip.open(ASSETS / "grpo" / "expected.json.gz", "rt") as f:
        rollout = json.load(f)["rollouts"][0]
    hf_to_ckpt(BASE, tmp_path / "base")
    cfg = lora_config(
        tmp_path,
        tmp_path / "base",
        "train.objective=grpo",
        "data.source=prompts",
        "data.paths=[unused]",
        f"data.tokenizer={CHATML}",
        "grpo.rewards=[unused:reward]",
        "grpo.group_size=4",
        "grpo.max_new_tokens=8",
        "grpo.temperature=0.8",
        "grpo.beta=0.1",
        "train.steps=1",
    )
    cfg, mesh, rules = on_mesh(cfg)
    rows = {
        k: np.asarray(v, np.float32 if k == "loss_mask" else np.int32)
        for k, v in rollout.items()
        if k != "rewards"
    }
    adv = grpo.advantages(np.asarray(rollout["rewards"], np.float32), 4, "group")
    weight, share = grpo.loss_weights(rows["loss_mask"], "dapo", 8)
    rows.update(advantages=np.repeat(adv[:, None], 16, axis=1), loss_weight=weight, token_share=share)
    plain = models.ModelConfig(**{**cfg.model.__dict__, "lora": None})
    g, abstract = models.abstract_model(lambda: models.Transformer(plain, rngs=nnx.Rngs(0)))

    def logps(params):
        logits = models.merge(g, abstract, params)(
            jnp.asarray(rows["inputs"]), positions=jnp.asarray(rows["positions"])
        )
        return grpo.token_logps(logits, jnp.asarray(rows["targets"]), 0.8)

    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        state = initial_state(cfg, program, abstract_state(program), lambda _: None)
        assert state.reference is None and state.frozen is not None
        whole = jax.device_get(lora.join(state.frozen, state.params))
        policy, reference = logps(lora.merged(whole, cfg.model)), logps(lora.split(whole)[0])
        rows["old_logps"] = np.asarray(policy) * rows["loss_mask"]
        _, metrics = program.step(
            state, {k: jax.device_put(v, program.batch_sharding) for k, v in rows.items()}
        )
        metrics = jax.device_get(metrics)
    loss, kl, _ = grpo.per_token_terms(
        policy, rows["old_logps"], reference, rows["advantages"], epsilon=0.2, epsilon_high=0.2, beta=0.1
    )
    want_kl = float(jnp.sum(share * kl))
    assert want_kl > 1e-4  # the adapters already matter
    np.testing.assert_allclose(float(metrics["grpo/kl"]), want_kl, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), float(jnp.sum(weight * loss)), rtol=1e-5, atol=1e-7)
