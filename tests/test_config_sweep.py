"""Every config error before the first step: a config that passes `validate` builds and runs.

Combinations of the features that constrain each other (pipeline stages and their
microbatches, gradient accumulation, held-out eval and its batch, fp8, fp16 loss scaling,
optimizer-state offload, ZeRO-1, expert parallelism) on the tiny models. For each: either
`validate` refuses it with a ConfigError naming a key, or one training step and one
evaluation run to a finite loss. The oracle is the run itself: a config that validates and
then fails inside the program is the bug this guards against (an eval batch the pipeline
cannot split used to pass validation and end the run with exit 70 at the first eval)."""

import math
import os
import re

import jax
import pytest

from jaxtrain.config import ConfigError, load_config, validate
from jaxtrain.trainer import train
from tests.conftest import REPO

QUIET = (
    "logging.progress=false",
    "logging.tensorboard=false",
    "train.steps=1",
    "eval.every=1",
    "eval.batches=1",
)
LAYERS4 = ("model.n_layers=4",)
COMBOS = {
    "pipeline+eval": ("mesh.stage=2", "mesh.data=2", "pipeline.microbatches=4", "eval.batch_size=8"),
    "pipeline+eval-unsplittable": ("mesh.stage=2", "pipeline.microbatches=4", "eval.batch_size=2"),
    "circular+microbatches": (
        *LAYERS4,
        "mesh.stage=2",
        "pipeline.schedule=circular",
        "pipeline.repeats=2",
        "train.microbatches=2",
        "pipeline.microbatches=2",
    ),
    "fp8+microbatches+eval": ("model.fp8=true", "model.compute_dtype=bfloat16", "train.microbatches=2"),
    "offload+zero1": (
        "mesh.data=2",
        "mesh.fsdp=2",
        "optimizer.offload=true",
        "optimizer.offload_params=true",
        "optimizer.shard_state=true",
    ),
    "fp8+offload": (
        "model.fp8=true",
        "model.compute_dtype=bfloat16",
        "optimizer.offload=true",
        "mesh.fsdp=2",
    ),
    "fp16+pipeline": ("model.compute_dtype=float16", "mesh.stage=2", "mesh.fsdp=2"),
    "fp8+pipeline": ("model.fp8=true", "model.compute_dtype=bfloat16", "mesh.stage=2"),
    "zero1+microbatches+eval": (
        "mesh.data=4",
        "optimizer.shard_state=true",
        "train.microbatches=2",
        "eval.batch_size=8",
    ),
    "muon+qk_clip+bf16_state+pipeline": (
        "optimizer.name=muon",
        "optimizer.qk_clip.tau=0.5",
        "optimizer.state_dtype=bfloat16",
        "mesh.stage=2",
        "mesh.fsdp=2",
        "eval.batch_size=8",
    ),
}
MOE_COMBOS = {
    "moe-expert+eval": ("mesh.expert=2", "mesh.fsdp=2", "eval.batch_size=4"),
    "moe-expert+pipeline": ("mesh.expert=2", "mesh.stage=2", "model.n_layers=4"),
    "moe-muon+qk_clip+microbatches": (
        "mesh.expert=2",
        "optimizer.name=muon",
        "optimizer.qk_clip.tau=0.5",
        "train.microbatches=2",
    ),
}


def _run_or_refuse(config: str, overrides, tmp_path) -> str:
    try:
        cfg = load_config(
            os.path.join(REPO, "configs", config), [*QUIET, *overrides, f"output_dir={tmp_path}"]
        )
        n = math.prod(cfg.mesh.sizes().values())
        validate(cfg, num_devices=n)
    except ConfigError as e:
        assert re.match(r"^[a-z_]+[.:=]", str(e)), f"the error names no key: {e}"
        return f"refused: {e}"
    result = train(cfg, devices=jax.devices()[:n])
    losses = [r["loss"] for r in result.metrics] + [r["eval_loss"] for r in result.evals]
    assert len(result.metrics) == 1 and len(result.evals) == 1, (result.metrics, result.evals)
    assert all(math.isfinite(x) for x in losses), losses
    return "ran"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMBOS) + sorted(MOE_COMBOS))
def test_a_config_that_validates_runs_a_step_and_an_eval(name, tmp_path):
    config, overrides = (
        ("tiny-moe.yaml", MOE_COMBOS[name]) if name in MOE_COMBOS else ("tiny.yaml", COMBOS[name])
    )
    outcome = _run_or_refuse(config, overrides, tmp_path)
    expected_refusals = {
        "pipeline+eval-unsplittable": "eval.batch_size=2: expected a multiple of",
        "fp8+pipeline": "model.fp8=true with mesh.stage=2",
    }
    if name in expected_refusals:
        assert outcome.startswith("refused: " + expected_refusals[name]), outcome
    else:
        assert outcome == "ran", outcome
