"""Kill -9 a post-training run of `jaxtrain train` and rerun the same command: chat SFT with
LoRA (adapter dropout on, fsdp=2 x tensor=2) and DPO with LoRA (data=2 x fsdp=2), both on a
converted Hugging Face base (train.init_from) and token directories from `jaxtrain tokenize`
(--chat, --preference). The resumed run must continue exactly where an uninterrupted one is.

Oracle: the same command run once without interruption; on CPU every logged step (loss,
gradient norm, learning rate, DPO's rewards) and the final checkpoint's adapters and their
optimizer state must be equal bit for bit (as tests/test_checkpoint_kill.py holds pretraining
to)."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from jaxtrain.interchange.convert import architecture_of, hf_to_ckpt
from jaxtrain.trainer.dpo import METRICS as DPO_METRICS
from tests.conftest import REPO
from tests.corpora import chatml_token_dirs
from tests.test_checkpoint_kill import env, finalized_steps, finish, records, wait_for

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring"),
]
ASSETS = Path(__file__).parent / "assets"
CHATML = ASSETS / "chat" / "chatml"
STEPS, EVERY = 24, 3  # DPO: 2 batches an epoch, so the checkpoint at 3 is mid-epoch
LORA = "{rank: 4, alpha: 8, targets: [wq, wk, wv, wo, w_gate, w_up, w_down]}"
COMPARED = ("loss", "grad_norm", "lr", "skipped_total")
# name: (metrics compared beyond COMPARED, overrides)
RUNS = {
    "chat-sft-lora": (
        ("grad_norm",),
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "train.global_batch_size=4",
        "train.seq_len=64",
        "data.packing=windows",  # conversations of 71+ tokens: whole-conversation rows would keep 65
        "model.lora.dropout=0.1",
    ),
    "dpo-lora": (
        DPO_METRICS,
        "mesh.data=2",
        "mesh.fsdp=2",
        "train.global_batch_size=4",
        "train.seq_len=48",
        "train.objective=dpo",
        "dpo.beta=0.2",
    ),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A config file whose model is the tiny HF Llama with its vocab padded to hold chatml's
    303 ids (converted with hf-to-ckpt), and the two token directories."""
    from safetensors.numpy import load_file, save_file

    tmp = tmp_path_factory.mktemp("post_training")
    hf = tmp / "hf"
    hf.mkdir()
    src = ASSETS / "hf" / "llama_gqa_rope_llama3"
    config = json.loads((src / "config.json").read_text())
    weights = load_file(src / "model.safetensors")
    rng = np.random.default_rng(0)
    vocab = 320
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[key]
        extra = rng.normal(0, 0.02, (vocab - w.shape[0], w.shape[1])).astype(w.dtype)
        weights[key] = np.concatenate([w, extra])
    config["vocab_size"] = vocab
    (hf / "config.json").write_text(json.dumps(config))
    save_file(weights, hf / "model.safetensors")
    model = hf_to_ckpt(hf, tmp / "base")
    run_config = yaml.safe_load(open(os.path.join(REPO, "configs", "tiny.yaml")))
    run_config["model"] = {**run_config["model"], **architecture_of(model)}
    (tmp / "config.yaml").write_text(yaml.safe_dump(run_config))

    chatml_token_dirs(tmp)  # tmp / "chat" and tmp / "pairs"
    return tmp


def start(setup, out_dir, name):
    _, *overrides = RUNS[name]
    data = setup / ("pairs" if "dpo" in name else "chat")
    cmd = [
        sys.executable,
        "-m",
        "jaxtrain",
        "train",
        str(setup / "config.yaml"),
        f"output_dir={out_dir}",
        f"train.init_from={setup / 'base'}",
        f"model.lora={LORA}",
        "data.source=tokens",
        f"data.paths=[{data}]",
        f"train.steps={STEPS}",
        f"checkpoint.every={EVERY}",
        "logging.progress=false",
        "logging.tensorboard=false",
        *overrides,
    ]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def final_checkpoint(out_dir):
    state = ocp.PyTreeCheckpointer().restore(os.path.join(out_dir, "checkpoints", str(STEPS), "state"))
    assert "frozen" not in state or not state["frozen"]  # adapters only, never the base
    return {k: state[k] for k in ("params", "opt_state")}


def flatten(tree, prefix=""):
    if isinstance(tree, dict | list | tuple):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        out = {}
        for k, v in items:
            out.update(flatten(v, f"{prefix}{k}/"))
        return out
    return {} if tree is None else {prefix: np.asarray(tree)}


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_kill_9_after_a_checkpoint_then_rerun_is_bit_identical(tmp_path, setup, name):
    compared = COMPARED + tuple(k for k in RUNS[name][0] if k not in COMPARED)
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    code, _, err = finish(start(setup, ref_dir, name))
    assert code == 0, err[-3000:]
    reference = {r["step"]: tuple(r[k] for k in compared) for r in records(ref_dir)}
    assert sorted(reference) == list(range(1, STEPS + 1))
    if "dpo" in name:  # fresh adapters (B = 0): the policy starts as the reference
        assert abs(reference[1][0] - np.log(2)) < 1e-6

    proc = start(setup, run_dir, name)
    wait_for(lambda: finalized_steps(run_dir / "checkpoints"), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    reached = max(r["step"] for r in records(run_dir))
    assert reached < STEPS, "the run finished before the kill"
    code, out, err = finish(start(setup, run_dir, name))
    assert code == 0, err[-3000:]
    resumed = int(re.search(r"resumed from step (\d+)", out).group(1))
    assert EVERY <= resumed <= reached and resumed % EVERY == 0, out
    rows = records(run_dir)
    assert {r["step"] for r in rows} == set(range(1, STEPS + 1))
    for r in rows:  # the steps run twice (after the checkpoint, before the kill) too
        assert tuple(r[k] for k in compared) == reference[r["step"]], (r, reference[r["step"]])

    want, got = flatten(final_checkpoint(ref_dir)), flatten(final_checkpoint(run_dir))
    assert want.keys() == got.keys() and any("lora" in k for k in want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
