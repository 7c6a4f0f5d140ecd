"""What works with what: the features a config can switch on, and for each pair of them the
test that runs the two together against an oracle, or the reason the config refuses them.

One table, read three ways: `jaxtrain.config.validate` refuses every refused pair a config
switches on (one line, exit 2, before anything compiles) and warns, in one line, of the pairs it
switches on that no test has run together yet; tests/test_compose.py checks that each tested
pair names a test that exists and carries ``@pytest.mark.composes("a+b")``, and that each
refused pair is refused with its reason; `docs_markdown` writes docs/composition.md ("What works
with what"). A new feature adds its row: a `Feature` in FEATURES and its pairs in TABLE.

A pair absent from TABLE is `Untested`: accepted, nobody has run it against an oracle. Features
of one `group` are values of one key (the objective, the pipeline schedule, the compute dtype,
the optimizer, dense or MoE): never on together, so they form no pair.

Nothing here imports jax (the CLI validates a config before any backend starts)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

# jaxtrain.config.Config, not imported: config.validate reads this table, and the import graph
# stays one way (tests/test_packaging.py); docs/composition.md is written by compose_page.py
Config = Any

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Feature:
    """A switch of the run config. `on`: whether a config has it, as validation can tell (an
    `auto` that is resolved later counts as off: resolution picks it only where no pair refuses,
    planning/resolve.py); `minimal`: overrides of configs/tiny.yaml that switch it on alone
    (tests/test_compose.py builds each pair's config from two of these)."""

    name: str
    on: Callable[[Config], bool]
    minimal: tuple[str, ...]
    group: str | None = None  # features of one group are values of one key: never together


@dataclasses.dataclass(frozen=True)
class Tested:
    """Run together against an oracle (one device, torch, transformers, hand values) by this
    pytest node id, which carries ``@pytest.mark.composes`` naming the pair."""

    test: str


@dataclasses.dataclass(frozen=True)
class Refused:
    """Refused by config validation with this one line; ``{dotted.key}`` is the config's value
    there (``{dotted.key!r}``: its repr; tuples print as lists)."""

    reason: str

    def message(self, cfg: Config) -> str:
        def value(match: re.Match) -> str:
            v = cfg
            for part in match.group(1).split("."):
                v = getattr(v, part)
            if match.group(2):
                return repr(v)
            return str(list(v)) if isinstance(v, tuple) else str(v)

        return re.sub(r"\{([a-z_][a-z0-9_.]*)(!r)?\}", value, self.reason)


@dataclasses.dataclass(frozen=True)
class Untested:
    """Accepted, but nobody has run the two together against an oracle yet (the goal: none)."""


def _mesh_axis(axis: str) -> Callable[[Config], bool]:
    return lambda c: getattr(c.mesh, axis) not in (0, 1)  # > 1, or -1 (fills the rest)


def _schedule(name: str) -> Callable[[Config], bool]:
    return lambda c: c.mesh.stage not in (0, 1) and c.pipeline.schedule == name


def _chat_data(c: Config) -> bool:
    """Token directories written by `jaxtrain tokenize --chat` (their manifest says `chat`);
    read where the path is local (a URL's manifest is read when the data opens, not here)."""
    if c.data.source != "tokens":
        return False
    for path in c.data.paths:
        manifest = os.path.join(str(path), "manifest.json")
        if "://" in str(path) or not os.path.isfile(manifest):
            continue
        try:
            with open(manifest) as f:
                if json.load(f).get("chat") is not None:
                    return True
        except (OSError, ValueError, AttributeError):
            continue  # the data source names a bad manifest when it opens
    return False


def _state_16bit(c: Config) -> bool:
    state = c.optimizer.state_dtype or c.model.param_dtype  # null: the master weights' dtype
    return state in ("bfloat16", "float16")


_STAGE = ("mesh.stage=2", "model.n_layers=4")
_GRPO = (
    "train.objective=grpo",
    "data.source=prompts",
    "data.paths=[prompts.jsonl]",
    "grpo.rewards=[module:function]",
    "grpo.group_size=4",
    "grpo.max_new_tokens=16",
)
_MLA = "model.mla={kv_lora_rank: 16, qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 16}"
_LINEAR = (
    "model.layer_types=[linear_attention, full_attention]",
    "model.linear_attention={num_key_heads: 2, num_value_heads: 4, key_head_dim: 16, value_head_dim: 16}",
)
# chat's directory: tests/test_compose.py writes one with a chat manifest and puts its path here
CHAT_DIR = "CHAT_DIR"

FEATURES: tuple[Feature, ...] = (
    # objectives (train.objective); chat: lm on `tokenize --chat` directories
    Feature("lm", lambda c: c.train.objective == "lm" and not _chat_data(c), (), "objective"),
    Feature("chat", lambda c: c.train.objective == "lm" and _chat_data(c),
            ("data.source=tokens", f"data.paths=[{CHAT_DIR}]"), "objective"),
    Feature("dpo", lambda c: c.train.objective == "dpo",
            ("train.objective=dpo", "data.source=tokens", "data.paths=[pairs]"), "objective"),
    Feature("grpo", lambda c: c.train.objective == "grpo", _GRPO, "objective"),
    # the model
    Feature("dense", lambda c: c.model.moe is None, (), "mlp"),
    Feature("moe", lambda c: c.model.moe is not None, ("model.moe={num_experts: 4, top_k: 2}",), "mlp"),
    Feature("mla", lambda c: c.model.mla is not None, ("model.n_kv_heads=4", _MLA)),
    Feature("mtp", lambda c: c.model.mtp is not None, ("model.mtp={depth: 1}",)),
    Feature("sinks", lambda c: c.model.attention_sinks, ("model.attention_sinks=true",)),
    Feature("attention_pattern", lambda c: bool(c.model.attention_pattern),
            ("model.attention_pattern=[local, global]", "model.sliding_window=16")),
    Feature("qk_norm", lambda c: c.model.qk_norm != "none", ("model.qk_norm=head",)),
    Feature("final_softcap", lambda c: c.model.final_softcap is not None, ("model.final_softcap=30.0",)),
    # gated DeltaNet layers among the attention ones (model.layer_types; models/linear_attention.py)
    Feature("linear_attention", lambda c: c.model.has_linear_attention, _LINEAR),
    # mesh axes (within a slice or host; across them: multiprocess)
    Feature("data", _mesh_axis("data"), ("mesh.data=2",)),
    Feature("fsdp", _mesh_axis("fsdp"), ("mesh.fsdp=2",)),
    Feature("tensor", _mesh_axis("tensor"), ("mesh.tensor=2",)),
    Feature("sequence_parallel", lambda c: c.mesh.rules == "fsdp_tensor_sp" and _mesh_axis("tensor")(c),
            ("mesh.rules=fsdp_tensor_sp", "mesh.tensor=2")),
    Feature("expert", _mesh_axis("expert"), ("mesh.expert=2",)),
    Feature("context", _mesh_axis("context"), ("mesh.context=2",)),
    # pipeline schedules (mesh.stage > 1)
    Feature("gpipe", _schedule("gpipe"), _STAGE, "schedule"),
    Feature("circular", _schedule("circular"), (*_STAGE, "pipeline.schedule=circular", "pipeline.repeats=2"),
            "schedule"),
    Feature("1f1b", _schedule("1f1b"), (*_STAGE, "pipeline.schedule=1f1b"), "schedule"),
    Feature("interleaved_1f1b", _schedule("interleaved_1f1b"),
            (*_STAGE, "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2"), "schedule"),
    Feature("zero_bubble", _schedule("zero_bubble"), (*_STAGE, "pipeline.schedule=zero_bubble"), "schedule"),
    Feature("multiprocess", lambda c: c.mesh.dcn_data > 1 or c.mesh.dcn_fsdp > 1
            or (c.distributed.num_processes or 1) > 1, ("mesh.dcn_data=2",)),
    # training
    Feature("lora", lambda c: c.model.lora is not None, ("model.lora={rank: 2, targets: [wq]}",)),
    Feature("remat", lambda c: c.model.remat not in ("none", "auto"), ("model.remat=full",)),
    Feature("offload", lambda c: c.optimizer.offload or c.optimizer.offload_params,
            ("optimizer.offload=true",)),
    Feature("bf16", lambda c: c.model.compute_dtype == "bfloat16", ("model.compute_dtype=bfloat16",),
            "compute"),
    Feature("fp16", lambda c: c.model.compute_dtype == "float16", ("model.compute_dtype=float16",),
            "compute"),
    Feature("fp8", lambda c: c.model.fp8, ("model.fp8=true",)),
    Feature("state_16bit", _state_16bit, ("optimizer.state_dtype=bfloat16",)),
    Feature("adamw", lambda c: c.optimizer.name == "adamw", (), "optimizer"),
    Feature("muon", lambda c: c.optimizer.name == "muon", ("optimizer.name=muon",), "optimizer"),
    Feature("qk_clip", lambda c: c.optimizer.qk_clip.tau is not None, ("optimizer.qk_clip.tau=50",)),
    Feature("zero1", lambda c: c.optimizer.shard_state, ("optimizer.shard_state=true",)),
    # train.loss_chunk > 0; auto counts as off (resolve.py keeps the plain loss wherever a pair
    # here refuses the chunked one)
    Feature("chunked_loss", lambda c: isinstance(c.train.loss_chunk, int) and c.train.loss_chunk > 0,
            ("train.loss_chunk=32",)),
)  # fmt: skip

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")
TICK_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")  # the loss runs inside the pipeline


def _each(features: tuple[str, ...], status: Tested | Refused) -> dict:
    return dict.fromkeys(features, status)


def _tests(test: str, *features: str) -> dict:
    return dict.fromkeys(features, Tested(test))


# --- the covering array of tests/test_pairs.py ----------------------------------------------------

# Features that must not change a run's numbers: a mesh axis, a pipeline schedule, sequence
# parallelism, remat, offload, ZeRO-1, the chunked loss. A row of PAIR_ROWS switches on many
# features at once and runs on a mesh against the same config on one device with these off, so
# it tests each pair of its features that holds one of these (row_pairs).
TRANSPARENT = (
    "data", "fsdp", "tensor", "sequence_parallel", "expert", "context", *SCHEDULES,
    "remat", "offload", "zero1", "chunked_loss",
)  # fmt: skip

# row id -> the features the row switches on (each mesh axis at 2; a pipeline: 2 stages); chosen
# greedily to cover every accepted pair with a transparent feature
PAIR_ROWS: dict[str, tuple[str, ...]] = {
    "lm-gpipe-dp-fsdp": (
        "lm", "dense", "mla", "sinks", "data", "fsdp", "gpipe", "remat", "fp16", "adamw", "qk_clip",
        "chunked_loss",
    ),
    "lm-dp-tp-ep": (
        "lm", "moe", "mtp", "attention_pattern", "qk_norm", "data", "tensor", "sequence_parallel", "expert",
        "lora", "remat", "offload", "bf16", "state_16bit", "adamw", "zero1", "chunked_loss",
    ),
    "lm-fsdp-tp-ep": (
        "lm", "dense", "mtp", "sinks", "qk_norm", "fsdp", "tensor", "sequence_parallel", "expert", "remat",
        "offload", "muon", "zero1", "chunked_loss",
    ),
    "lm-circ-dp-cp": (
        "lm", "dense", "mla", "data", "context", "circular", "fp16", "state_16bit", "adamw", "qk_clip",
        "zero1", "chunked_loss",
    ),
    "lm-1f1b-tp-ep": (
        "lm", "dense", "mla", "tensor", "sequence_parallel", "expert", "1f1b", "fp16", "state_16bit",
        "adamw", "zero1", "chunked_loss",
    ),
    "lm-1f1b-dp-fsdp": (
        "lm", "moe", "qk_norm", "data", "fsdp", "1f1b", "remat", "offload", "bf16", "adamw", "zero1",
        "chunked_loss",
    ),
    "lm-i1f1b-ep": (
        "lm", "dense", "sinks", "qk_norm", "expert", "interleaved_1f1b", "remat", "offload", "muon",
        "chunked_loss",
    ),
    "chat-gpipe-ep": (
        "chat", "moe", "sinks", "qk_norm", "final_softcap", "expert", "gpipe", "lora", "muon", "zero1",
    ),
    "chat-circ-tp-cp": (
        "chat", "moe", "sinks", "qk_norm", "final_softcap", "tensor", "sequence_parallel", "context",
        "circular", "lora", "remat", "offload", "muon",
    ),
    "chat-zb-dp-fsdp": (
        "chat", "dense", "mla", "sinks", "data", "fsdp", "zero_bubble", "remat", "offload", "adamw", "zero1",
        "chunked_loss",
    ),
    "chat-1f1b-dp-fsdp": ("chat", "dense", "sinks", "final_softcap", "data", "fsdp", "1f1b", "remat", "muon"),
    "grpo-fsdp-tp-ep": (
        "grpo", "moe", "sinks", "qk_norm", "final_softcap", "fsdp", "tensor", "sequence_parallel", "expert",
        "remat", "offload", "adamw", "zero1",
    ),
    "chat-i1f1b-dp-tp": (
        "chat", "moe", "mla", "final_softcap", "data", "tensor", "sequence_parallel", "interleaved_1f1b",
        "bf16", "state_16bit", "adamw", "zero1",
    ),
    "lm-zb-tp": (
        "lm", "dense", "qk_norm", "final_softcap", "tensor", "sequence_parallel", "zero_bubble", "offload",
        "fp16", "state_16bit", "muon",
    ),
    "dpo-circ-tp-ep": (
        "dpo", "moe", "tensor", "sequence_parallel", "expert", "circular", "remat", "offload", "adamw",
        "zero1",
    ),
    "lm-gpipe-tp-ep": (
        "lm", "moe", "tensor", "sequence_parallel", "expert", "gpipe", "offload", "bf16", "state_16bit",
        "adamw", "qk_clip",
    ),
    "lm-fsdp-cp-ep": (
        "lm", "moe", "fsdp", "context", "expert", "remat", "offload", "bf16", "fp8", "adamw", "zero1",
        "chunked_loss",
    ),
    "lm-dp-tp-fp8": ("lm", "dense", "data", "tensor", "sequence_parallel", "fp8", "adamw"),
    "lm-i1f1b-fp16": ("lm", "dense", "interleaved_1f1b", "fp16", "adamw"),
    "lm-zb-bf16": ("lm", "dense", "zero_bubble", "bf16", "adamw"),
    "lm-linear-dp-tp-ep": (
        "lm", "dense", "linear_attention", "qk_norm", "data", "tensor", "sequence_parallel", "expert",
        "remat", "offload", "adamw", "zero1", "chunked_loss",
    ),
}  # fmt: skip


# tests/test_multiprocess_rows.py: each row trains on two processes (mesh.dcn_data=2 across them,
# the rest of its mesh, 4 devices, inside each) against the same config in one process on the same
# 8-device mesh (mesh.data=2 for dcn_data), so it tests multiprocess with each of its features
PROCESS_ROWS: dict[str, tuple[str, ...]] = {
    "chat-moe-mtp-tp-ep": (
        "chat", "moe", "mtp", "sinks", "attention_pattern", "qk_norm", "tensor", "sequence_parallel",
        "expert", "lora", "remat", "offload", "bf16", "state_16bit", "adamw", "zero1", "chunked_loss",
    ),
    "dpo-mla-gpipe-cp": ("dpo", "dense", "mla", "final_softcap", "context", "gpipe", "fp16", "muon"),
    "lm-fp8-fsdp-tp": ("lm", "dense", "fsdp", "tensor", "fp8", "adamw"),
    "lm-circ-fsdp": ("lm", "dense", "fsdp", "circular", "adamw", "qk_clip"),
    "lm-1f1b-tp": ("lm", "dense", "tensor", "1f1b", "adamw"),
    "lm-i1f1b-ep": ("lm", "moe", "expert", "interleaved_1f1b", "muon"),
    "lm-zb-fsdp": ("lm", "dense", "fsdp", "zero_bubble", "adamw"),
    "lm-linear-fsdp-tp": ("lm", "dense", "linear_attention", "fsdp", "tensor", "adamw"),
}  # fmt: skip


def process_pairs(features: tuple[str, ...]) -> list[tuple[str, str]]:
    """The pairs a row of PROCESS_ROWS tests: multiprocess with each of its features."""
    return [pair("multiprocess", f) for f in features]


def row_pairs(features: tuple[str, ...]) -> list[tuple[str, str]]:
    """The pairs a row of PAIR_ROWS tests: those of its features that hold a transparent one."""
    on = sorted(features, key=NAMES.index)
    return [(a, b) for a, b in itertools.combinations(on, 2) if a in TRANSPARENT or b in TRANSPARENT]


def _rows() -> dict[tuple[str, str], Tested]:
    """Each pair of PAIR_ROWS, then of PROCESS_ROWS, under the first row that covers it."""
    out: dict[tuple[str, str], Tested] = {}
    for row, features in PAIR_ROWS.items():
        for p in row_pairs(features):
            out.setdefault(p, Tested(f"tests/test_pairs.py::test_row_equals_one_device[{row}]"))
    for row, features in PROCESS_ROWS.items():
        for p in process_pairs(features):
            out.setdefault(p, Tested(f"tests/test_multiprocess_rows.py::test_two_processes_equal_one[{row}]"))
    return out


# --- the reasons, each once (the schedules share theirs) ----------------------------------------

_STAGES_OVER_PATTERNS = Refused(
    "mesh.stage={mesh.stage} with model.attention_pattern={model.attention_pattern}: pipeline stages "
    "over layer patterns are not supported yet; expected mesh.stage=1"
)
_FP8_STAGES = Refused("model.fp8=true with mesh.stage={mesh.stage}: fp8 is not supported with pipelines yet")
_MTP_STAGES = Refused(
    "model.mtp with mesh.stage={mesh.stage}: the prediction modules do not run in a pipeline yet; "
    "expected mesh.stage=1 or model.mtp null"
)
_MTP_OBJECTIVE = Refused(
    "model.mtp with train.objective={train.objective}: the prediction modules train with the LM "
    "objective only; expected train.objective=lm or model.mtp null"
)
_GRPO_STAGES = Refused(
    "mesh.stage={mesh.stage} with train.objective=grpo: the sampler does not run pipeline stages; "
    "expected mesh.stage=1"
)
_TICK_OBJECTIVE = Refused(
    "pipeline.schedule={pipeline.schedule} with train.objective={train.objective}: expected lm (or "
    "pipeline.schedule=gpipe or circular)"
)
_TICK_LORA = Refused(
    "pipeline.schedule={pipeline.schedule} with model.lora: expected pipeline.schedule=gpipe or circular"
)
_TICK_CONTEXT = Refused(
    "mesh.context={mesh.context} with pipeline.schedule={pipeline.schedule}: the ring attention's "
    "collectives inside the tick schedules deadlock; expected pipeline.schedule=gpipe or circular, or "
    "mesh.context=1"
)
_TICK_QK_CLIP = Refused(  # the logits are recorded outside the tick loops
    "pipeline.schedule={pipeline.schedule} with optimizer.qk_clip.tau={optimizer.qk_clip.tau}: QK-clip "
    "records its logits in the gpipe and circular schedules only so far; expected "
    "pipeline.schedule=gpipe or circular"
)
_QK_CLIP_OBJECTIVE = Refused(
    "optimizer.qk_clip.tau={optimizer.qk_clip.tau} with train.objective={train.objective!r}: QK-clip "
    "records the logits of the LM objective's forward pass; expected train.objective=lm"
)
# models/config.py refuses these first (ModelConfig.validate also guards models built without a
# run config); the table says the same line


_LINEAR_LAYERS = "with linear_attention layers (model.layer_types)"


def _linear_not(key: str) -> Refused:
    return Refused(
        f"model.{key}={{model.{key}!r}} {_LINEAR_LAYERS}: not supported yet; expected model.{key} off"
    )


_LINEAR_STAGES = Refused(f"mesh.stage={{mesh.stage!r}} {_LINEAR_LAYERS}: expected 1 (no pipeline stages)")


def _mla_not(key: str) -> Refused:
    return Refused(f"model.{key}={{model.{key}!r}} with model.mla: not supported with latent attention")


# --- the tests that run several pairs ---------------------------------------------------------

_MESHES = "tests/test_sharded_training.py::test_training_losses_match_across_meshes"
_RING_TP_DP = "tests/test_context_parallel.py::test_ring_context2_tensor2_data2_matches_single_device"
_ONE_F_ONE_B = "tests/test_pipeline_schedules.py::test_1f1b_stage2_fsdp2_tensor2_equals_one_device[2]"
_MOE_1F1B = (
    "tests/test_pipeline_schedules.py::test_moe_stages_with_expert_parallelism_equal_one_device[1f1b-0]"
)
_MOE_ZB = "tests/test_pipeline_schedules.py::test_moe_stages_with_expert_parallelism_equal_one_device[zero_bubble-2]"  # noqa: E501
_LORA_MOE_MESH = (
    "tests/test_lora.py::test_adapters_on_tensor_and_expert_meshes_equal_one_device_and_follow_the_rules"  # noqa: E501
)
_DPO_TORCH = "tests/test_dpo.py::test_dpo_steps_equal_torch_on_a_data_fsdp_mesh"
_DPO_MESHES = "tests/test_dpo.py::test_dpo_on_tensor_context_and_pipeline_meshes_equals_one_device"
_GRPO_TORCH = "tests/test_grpo.py::test_grpo_steps_and_weights_equal_torch_on_a_data_fsdp_mesh[1]"
_FP8_EXPERTS = "tests/test_precision.py::test_fp8_expert_scales_are_mesh_wide"
_CHUNKED_MESH = "tests/test_chunked_loss.py::test_program_sharded_matches_plain_single_device[untied]"
_MLA_CLIP = "tests/test_qk_clip.py::test_a_step_clips_the_latent_attention_heads_over_tau"
_MLA_SINKS = (
    "tests/test_mla_sinks_and_out_bias.py::test_latent_attention_with_sinks_and_out_bias_equals_numpy"
)
_TEXTBOOK = (
    "tests/test_loss_curve.py::test_tiny_config_loss_curve_matches_a_textbook_loop_and_the_stored_curve"  # noqa: E501
)
_MUON_TORCH = "tests/test_muon.py::test_muon_equals_torch_muon_on_meshes[mesh.data=2 mesh.fsdp=2]"
_ZERO1 = "tests/test_zero1.py::test_zero1_matches_one_device_and_plain_data_parallelism"
_GPIPE_FSDP = "tests/test_pipeline.py::test_gpipe_stage2_with_fsdp_equals_one_device"
_CIRCULAR_TP = "tests/test_pipeline.py::test_pipelines_equal_one_device[circular-s2-r2-tensor]"
_MOE_GPIPE = "tests/test_pipeline.py::test_moe_in_stages_with_expert_parallelism_equals_one_device"
_ZB = "tests/test_pipeline_schedules.py::test_zero_bubble_equals_one_device[2]"
_INTERLEAVED = (
    "tests/test_pipeline_schedules.py::test_interleaved_1f1b_8_layers_repeats2_equals_one_device[2]"
)
_MOE_DATA = "tests/test_moe.py::test_expert_parallel_matches_single_device[capacity-data=2,expert=4]"
_MLA_MESH = "tests/test_deepseek.py::test_sharded_step_equals_one_device[fsdp,tensor,expert]"
_MTP_STEP = "tests/test_mtp.py::test_step_objective_matches_the_reference"
_MTP_MOE_MESH = "tests/test_mtp.py::test_sharded_step_matches_one_device[moe-expert2,fsdp2,tensor2]"
_FAMILY = "tests/test_model_families.py::test_sharded_step_equals_one_device"
_GEMMA2_RING = (
    "tests/test_model_families.py::test_gemma2_attention_on_the_kernels_and_the_ring_equals_xla_on_one_device"
    "[mesh0-xla-ring]"
)
_GEMMA3_LOSS = "tests/test_model_families.py::test_training_starts_from_a_converted_gemma3_checkpoint"
_HF_LOGITS = "tests/test_hf.py::test_from_hf_logits_match_transformers"
_GPT_OSS_HF = "tests/test_gpt_oss.py::test_yarn_on_sliding_and_full_layers_matches_transformers"
_GRPO_MOE = "tests/test_grpo.py::test_grpo_on_moe_adds_the_router_loss_as_trl_does"
_OFFLOAD = "tests/test_offload.py::test_offloaded_optimizer_state_trains_identically_and_resumes"
_FP8_BF16 = "tests/test_precision.py::test_fp8_tracks_bf16"
_FP16_BF16 = "tests/test_precision.py::test_fp16_tracks_bf16"
_STATE_CURVE = "tests/test_state_dtype.py::test_bfloat16_state_tiny_loss_curve_follows_float32_at_b2_0999"
_QK_CLIP_STEP = "tests/test_qk_clip.py::test_a_step_clips_the_heads_the_forward_pass_found_over_tau"
_SP = "tests/test_sequence_parallel.py::test_sequence_parallel_matches_one_device"
_TWO_PROCESSES = "tests/test_multiprocess.py::test_two_processes_train_as_one_mesh_and_checkpoints_cross"
_LORA_PEFT = "tests/test_lora.py::test_losses_and_final_adapters_equal_torch_peft"
_MUON_MOE_MESH = "tests/test_muon.py::test_muon_on_expert_pipeline_zero1_and_offload_meshes_equals_one_device"
_REMAT = "tests/test_model.py::test_every_remat_policy_gives_the_gradients_of_none"
_HYBRID_REF = "tests/test_hybrid_layers.py::test_hybrid_matches_plain_jnp_reference"
_HYBRID_MESH = "tests/test_hybrid_layers.py::test_sharded_step_equals_one_device"

# the LM objective on the dense model (the defaults) with each of these, against an oracle
# without it (one device, no pipeline, float32 or bf16, one process) or by hand / torch + peft
_LM_DENSE = {
    "gpipe": _GPIPE_FSDP,
    "circular": _CIRCULAR_TP,
    "interleaved_1f1b": _INTERLEAVED,
    "zero_bubble": _ZB,
    "mtp": _MTP_STEP,
    "sequence_parallel": _SP,
    "multiprocess": _TWO_PROCESSES,
    "lora": _LORA_PEFT,
    "offload": _OFFLOAD,
    "fp16": _FP16_BF16,
    "fp8": _FP8_BF16,
    "state_16bit": _STATE_CURVE,
    "qk_clip": f"{_QK_CLIP_STEP}[mha]",
    "zero1": _ZERO1,
    "chunked_loss": _CHUNKED_MESH,
}


# --- the table: each pair once, under the feature listed first in FEATURES ----------------------

TABLE: dict[str, dict[str, Tested | Refused]] = {
    "lm": {
        **_tests(_TEXTBOOK, "dense", "adamw"),
        "muon": Tested(_MUON_TORCH),
        **_tests(_MESHES, "data", "fsdp", "tensor"),
        **_tests(_RING_TP_DP, "context"),
        **_tests(_ONE_F_ONE_B, "1f1b"),
        **{f: Tested(t) for f, t in _LM_DENSE.items()},
        **_tests(_GEMMA3_LOSS, "attention_pattern", "qk_norm"),
    },
    "chat": {
        "dense": Tested("tests/test_chat.py::test_step_loss_is_the_mean_over_masked_in_targets"),
    },
    "dpo": {
        **_tests(_DPO_TORCH, "dense", "data", "fsdp", "adamw"),
        **_tests(_DPO_MESHES, "tensor", "context", "gpipe"),
        **_each(TICK_SCHEDULES, _TICK_OBJECTIVE),
        "mtp": _MTP_OBJECTIVE,
        "lora": Tested("tests/test_dpo.py::test_dpo_with_lora_takes_the_base_as_its_reference"),
        "qk_clip": _QK_CLIP_OBJECTIVE,
        "chunked_loss": Refused(
            "train.loss_chunk={train.loss_chunk} with train.objective=dpo: DPO needs each sequence's "
            "log-probability, which the chunked loss does not give; expected 0 or auto"
        ),
    },
    "grpo": {
        **_tests(_GRPO_TORCH, "dense", "data", "fsdp", "adamw"),
        "moe": Tested("tests/test_grpo.py::test_grpo_on_moe_adds_the_router_loss_as_trl_does"),
        "qk_norm": Tested(_GRPO_MOE),
        "mtp": _MTP_OBJECTIVE,
        "context": Refused(
            "mesh.context={mesh.context} with train.objective=grpo: rollouts are not laid out in the "
            "zig-zag order context attention expects, nor does the sampler run context parallelism; "
            "expected mesh.context=1"
        ),
        **_each(SCHEDULES, _GRPO_STAGES),
        "multiprocess": Tested(
            "tests/test_grpo_multiprocess.py::test_grpo_on_two_processes_equals_one_process"
        ),
        "lora": Tested("tests/test_grpo.py::test_grpo_with_lora_takes_the_base_as_its_reference"),
        "qk_clip": _QK_CLIP_OBJECTIVE,
        "chunked_loss": Refused(
            "train.loss_chunk={train.loss_chunk} with train.objective=grpo: GRPO needs every completion "
            "token's log-probability, which the chunked loss does not give; expected 0 or auto"
        ),
    },
    "dense": {
        **_tests(_TEXTBOOK, "adamw"),
        "muon": Tested(_MUON_TORCH),
        **_tests(_MESHES, "data", "fsdp", "tensor"),
        **_tests(_RING_TP_DP, "context"),
        **_tests(_ONE_F_ONE_B, "1f1b"),
        **{f: Tested(t) for f, t in _LM_DENSE.items()},
        **_tests(f"{_HF_LOGITS}[gemma2_softcap]", "attention_pattern", "final_softcap"),
        "qk_norm": Tested(f"{_HF_LOGITS}[gemma3_pattern]"),
        "remat": Tested("tests/test_model.py::test_remat_and_unrolled_layers_change_nothing"),
        "bf16": Tested("tests/test_model.py::test_bf16_compute_close_to_f32"),
    },
    "moe": {
        **_tests(_LORA_MOE_MESH, "fsdp", "tensor", "expert"),
        **_tests(_MOE_1F1B, "1f1b"),
        **_tests(_MOE_ZB, "zero_bubble"),
        "fp8": Tested(_FP8_EXPERTS),
        "muon": Tested(
            "tests/test_muon.py::test_one_step_of_stacked_expert_matrices_equals_a_loop_over_matrices"
        ),
        "data": Tested(_MOE_DATA),
        "gpipe": Tested(_MOE_GPIPE),
        **_tests(_GPT_OSS_HF, "sinks", "attention_pattern"),
        "qk_norm": Tested(f"{_HF_LOGITS}[qwen3_moe]"),
        "remat": Tested(f"{_REMAT}[minimal]"),
        "offload": Tested(f"{_MUON_MOE_MESH}[stage-fsdp-offload]"),
        "adamw": Tested(_GRPO_MOE),
        "zero1": Tested(f"{_MUON_MOE_MESH}[data-expert-tensor-zero1]"),
    },
    "mla": {
        "moe": Tested(  # DeepSeek-V3 (FP8 asset) against transformers' logits
            "tests/test_fp8_checkpoints.py::test_from_hf_dequantizes_by_deepseeks_rule_and_matches_transformers"
        ),
        "sinks": Tested(_MLA_SINKS),
        "attention_pattern": _mla_not("attention_pattern"),
        "qk_norm": _mla_not("qk_norm"),
        "lora": _mla_not("lora"),
        "fp8": _mla_not("fp8"),
        "muon": Tested(
            "tests/test_muon.py::test_one_step_of_latent_attention_equals_torch_muon_on_hfs_matrices"
        ),
        "qk_clip": Tested(_MLA_CLIP),
        **_tests(_MLA_MESH, "fsdp", "tensor", "expert"),
    },
    "mtp": {
        "fsdp": Tested("tests/test_mtp.py::test_sharded_step_matches_one_device[fsdp2,tensor2]"),
        "tensor": Tested("tests/test_mtp.py::test_sharded_step_matches_one_device[fsdp2,tensor2]"),
        "expert": Tested(_MTP_MOE_MESH),
        "context": Refused(  # context parallelism keeps rows in zig-zag order (sharding/context.py)
            "model.mtp with mesh.context={mesh.context}: the prediction modules read tokens ahead in "
            "sequence order, which context parallelism permutes; expected mesh.context=1 or model.mtp null"
        ),
        **_each(SCHEDULES, _MTP_STAGES),
        "remat": Tested("tests/test_mtp.py::test_remat_and_unrolled_modules_change_nothing"),
        "fp8": Refused(
            "model.mtp with model.fp8=true: the prediction modules have no fp8 state yet; expected "
            "model.mtp null or model.fp8 false"
        ),
        "qk_clip": Refused(  # the prediction modules' attention layers record nothing yet
            "optimizer.qk_clip.tau={optimizer.qk_clip.tau} with model.mtp: QK-clip clips the main "
            "layers' attention only, not yet the prediction modules'; expected "
            "optimizer.qk_clip.tau=null or model.mtp=null"
        ),
        "muon": Tested(
            "tests/test_muon.py::test_one_step_of_the_prediction_modules_equals_torch_muon_per_depth"
        ),
        "chunked_loss": Tested("tests/test_mtp.py::test_loss_and_gradients_match_the_reference[chunked]"),
    },
    "sinks": {
        "attention_pattern": Tested(
            "tests/test_gpt_oss.py::test_yarn_on_sliding_and_full_layers_matches_transformers"
        ),
        **_tests(f"{_FAMILY}[gpt-oss-moe]", "fsdp", "tensor", "expert"),
    },
    "attention_pattern": {
        **_each(SCHEDULES, _STAGES_OVER_PATTERNS),
        "final_softcap": Tested(f"{_HF_LOGITS}[gemma2_softcap]"),
        "qk_norm": Tested(f"{_HF_LOGITS}[gemma3_pattern]"),
        **_tests(f"{_FAMILY}[gemma2-all]", "fsdp", "tensor"),
        "expert": Tested(f"{_FAMILY}[gpt-oss-moe]"),
        "context": Tested(_GEMMA2_RING),
    },
    "qk_norm": {
        **_tests(f"{_FAMILY}[head-norm+moe]", "fsdp", "tensor", "expert"),
        **_tests(_GRPO_MOE, "data", "adamw"),
        "qk_clip": Refused(
            "optimizer.qk_clip.tau={optimizer.qk_clip.tau} with model.qk_norm={model.qk_norm!r}: the norm "
            "undoes a scaled query or key weight; expected optimizer.qk_clip.tau=null or model.qk_norm=none"
        ),
    },
    "final_softcap": {
        **_tests(f"{_FAMILY}[gemma2-all]", "fsdp", "tensor"),
        "context": Tested(_GEMMA2_RING),
        "chunked_loss": Refused(
            "train.loss_chunk={train.loss_chunk} with model.final_softcap={model.final_softcap}: the "
            "chunked loss takes no softcap yet; expected train.loss_chunk 0 or auto"
        ),
    },
    "data": {
        **_tests(_MESHES, "fsdp", "tensor"),
        **_tests(_RING_TP_DP, "context"),
        "adamw": Tested(_MESHES),
        "zero1": Tested(_ZERO1),
        **_tests(_GPIPE_FSDP, "gpipe"),
        "circular": Tested(_CIRCULAR_TP),
        "expert": Tested(_MOE_DATA),
        "sequence_parallel": Tested(_SP),
        "multiprocess": Tested(_TWO_PROCESSES),
        "lora": Tested(_LORA_PEFT),
        "muon": Tested(_MUON_TORCH),
        "chunked_loss": Tested(
            "tests/test_head_sharding.py::test_vocab_parallel_matches_single_device[chunked-data]"
        ),
    },
    "fsdp": {
        "bf16": Tested("tests/test_precision.py::test_bf16_tracks_float32_on_one_device_and_on_meshes"),
        "tensor": Tested(_MESHES),
        "expert": Tested(_LORA_MOE_MESH),
        **_tests(_ONE_F_ONE_B, "1f1b"),
        "zero_bubble": Tested(_MOE_ZB),
        "adamw": Tested(_MESHES),
        "muon": Tested(_MUON_TORCH),
        "chunked_loss": Tested(_CHUNKED_MESH),
        "gpipe": Tested(_GPIPE_FSDP),
        "circular": Tested("tests/test_pipeline.py::test_pipelines_equal_one_device[circular-s4-r2-fsdp]"),
        "interleaved_1f1b": Tested(_INTERLEAVED),
        "sequence_parallel": Tested(_SP),
        "multiprocess": Tested(_TWO_PROCESSES),
        "offload": Tested(_OFFLOAD),
        "fp8": Tested(_FP8_EXPERTS),
        "qk_clip": Tested(f"{_QK_CLIP_STEP}[gqa-microbatches-fsdp]"),
    },
    "tensor": {
        "expert": Tested(_LORA_MOE_MESH),
        "context": Tested(_RING_TP_DP),
        "gpipe": Tested(_DPO_MESHES),
        "1f1b": Tested(_ONE_F_ONE_B),
        "adamw": Tested(_MESHES),
        "fp8": Tested(_FP8_EXPERTS),
        "chunked_loss": Tested(_CHUNKED_MESH),
        "sequence_parallel": Tested(_SP),
        "circular": Tested(_CIRCULAR_TP),
        "interleaved_1f1b": Tested(_INTERLEAVED),
        "zero_bubble": Tested(_ZB),
        "muon": Tested(
            "tests/test_muon.py::test_muon_equals_torch_muon_on_meshes[mesh.fsdp=2 mesh.tensor=2]"
        ),
        "zero1": Tested(f"{_MUON_MOE_MESH}[data-expert-tensor-zero1]"),
    },
    "expert": {
        "1f1b": Tested(_MOE_1F1B),
        "zero_bubble": Tested(_MOE_ZB),
        "fp8": Tested(_FP8_EXPERTS),
        "gpipe": Tested(_MOE_GPIPE),
        **_tests(f"{_MUON_MOE_MESH}[data-expert-tensor-zero1]", "muon", "zero1"),
    },
    "context": {
        "gpipe": Tested(_DPO_MESHES),
        "adamw": Tested(_RING_TP_DP),
        # found by tests/test_pairs.py: the step's collectives deadlock (XLA:CPU aborts after its
        # 40 s rendezvous timeout), plain lm on stage=2 x context=2 alike
        **_each(TICK_SCHEDULES, _TICK_CONTEXT),
    },
    # gated DeltaNet layers (model.layer_types), all their pairs here (models/config.py and
    # config._validate_linear_attention refuse theirs); the objectives, optimizers and 16-bit
    # numbers: _ORACLE_ROWS below; the transparent features: PAIR_ROWS' lm-linear-dp-tp-ep
    "linear_attention": {
        **_tests(f"{_HYBRID_REF}[plain]", "lm", "dense", "qk_norm"),
        "sinks": Tested(f"{_HYBRID_REF}[sinks]"),
        **_tests(_HYBRID_MESH, "data", "fsdp", "tensor"),
        "moe": Tested("tests/test_model_families.py::test_sharded_step_equals_one_device[qwen3.5-moe]"),
        **{k: _linear_not(k) for k in ("mla", "mtp", "fp8")},
        "lora": Tested(
            "tests/test_lora.py::test_peft_adapter_on_the_hybrids_deltanet_and_gated_query_gives_peft_logits"
        ),
        "attention_pattern": Refused(
            "model.layer_types with model.attention_pattern={model.attention_pattern}: not supported "
            "together yet; expected attention_pattern []"
        ),
        "context": Refused(
            f"mesh.context={{mesh.context!r}} {_LINEAR_LAYERS}: expected 1 (the state is not passed "
            "between shards yet)"
        ),
        **_each(SCHEDULES, _LINEAR_STAGES),
        "qk_clip": Tested("tests/test_hybrid_layers.py::test_qk_clip_scales_the_full_layers_heads_over_tau"),
    },
    # the pipeline schedules
    **{s: {"fp8": _FP8_STAGES} for s in ("gpipe", "circular")},
    **{s: {"lora": _TICK_LORA, "fp8": _FP8_STAGES, "qk_clip": _TICK_QK_CLIP} for s in TICK_SCHEDULES},
    "multiprocess": {
        "adamw": Tested(_TWO_PROCESSES),
    },
    "offload": {
        "gpipe": Tested(f"{_MUON_MOE_MESH}[stage-fsdp-offload]"),
        "adamw": Tested(_OFFLOAD),
        "muon": Tested(f"{_MUON_MOE_MESH}[stage-fsdp-offload]"),
    },
    "bf16": {
        **_tests(
            "tests/test_precision.py::test_bf16_tracks_float32_on_one_device_and_on_meshes",
            "adamw",
            "circular",
        ),
        "fp8": Tested("tests/test_precision.py::test_fp8_tracks_bf16"),
        "chunked_loss": Tested("tests/test_chunked_loss.py::test_bf16_compute_close_to_f32"),
    },
    "fp16": {
        "fp8": Refused(
            "model.fp8=true with model.compute_dtype='float16': fp8 scaling and loss scaling together "
            "are not supported; use compute_dtype bfloat16"
        ),
        "adamw": Tested(_FP16_BF16),
    },
    "fp8": {
        "adamw": Tested(_FP8_BF16),
    },
    "lora": {
        **_tests(_LORA_MOE_MESH, "fsdp", "tensor", "expert"),
        "qk_clip": Refused(
            "optimizer.qk_clip.tau={optimizer.qk_clip.tau} with model.lora: the query and key weights "
            "are frozen; expected optimizer.qk_clip.tau=null"
        ),
        "adamw": Tested(_LORA_PEFT),
    },
    "state_16bit": {
        "fsdp": Tested("tests/test_state_dtype.py::test_bfloat16_state_on_fsdp_equals_one_device"),
        "adamw": Tested("tests/test_state_dtype.py::test_bfloat16_adam_moments_follow_float32_at_b_0999"),
        "muon": Tested("tests/test_state_dtype.py::test_bfloat16_muon_momentum_follows_float32_at_0999"),
    },
    "adamw": {
        "zero1": Tested(_ZERO1),
        "qk_clip": Tested(f"{_QK_CLIP_STEP}[mha]"),
    },
    "muon": {
        "qk_clip": Tested(_MLA_CLIP),
        "zero1": Tested(f"{_MUON_MOE_MESH}[data-expert-tensor-zero1]"),
        "gpipe": Tested(f"{_MUON_MOE_MESH}[stage-fsdp-offload]"),
    },
}

# tests/test_feature_oracles.py: pairs of non-transparent features on one device, each row against
# a plain recomputation of its objective and a hand-written optimizer step (_ORACLES), or, 16-bit
# rows, against the same row in float32 (_LOW); each pair under its first row
_ORACLES = "tests/test_feature_oracles.py::test_objective_and_update_equal_plain_oracles"
_LOW = "tests/test_feature_oracles.py::test_low_precision_tracks_float32"
_ORACLE_ROWS: dict[str, str] = {
    f"{_ORACLES}[lm-moe-mla-mtp-sinks-softcap-muon]": (
        "lm+moe lm+mla lm+sinks lm+final_softcap sinks+muon final_softcap+muon moe+mtp mtp+final_softcap"
        " moe+final_softcap mla+final_softcap"
    ),
    f"{_ORACLES}[chat-mla-mtp-sinks-softcap-adamw]": (
        "chat+mla chat+mtp chat+sinks chat+final_softcap mla+adamw mtp+adamw sinks+adamw"
        " final_softcap+adamw chat+adamw"
    ),
    f"{_ORACLES}[chat-moe-sinks-pattern-qknorm-softcap-lora-muon]": (
        "chat+moe chat+attention_pattern chat+qk_norm chat+lora attention_pattern+muon"
        " qk_norm+muon lora+muon chat+muon"
    ),
    f"{_ORACLES}[dpo-moe-sinks-pattern-qknorm-softcap-adamw]": (
        "dpo+moe dpo+sinks dpo+attention_pattern dpo+qk_norm dpo+final_softcap attention_pattern+adamw"
    ),
    f"{_ORACLES}[dpo-mla-muon]": ("dpo+mla dpo+muon"),
    f"{_ORACLES}[grpo-mla-sinks-softcap-muon]": ("grpo+mla grpo+sinks grpo+final_softcap grpo+muon"),
    f"{_LOW}[lm-moe-mla-mtp-sinks-softcap-muon+bf16+state16]": (
        "lm+bf16 moe+bf16 mla+bf16 mtp+bf16 sinks+bf16 final_softcap+bf16 bf16+muon"
        " bf16+state_16bit moe+state_16bit mla+state_16bit mtp+state_16bit sinks+state_16bit"
        " final_softcap+state_16bit"
    ),
    f"{_LOW}[chat-moe-sinks-pattern-qknorm-softcap-lora-muon+bf16+fp8+state16]": (
        "chat+bf16 attention_pattern+bf16 qk_norm+bf16 lora+bf16 chat+fp8 sinks+fp8"
        " attention_pattern+fp8 qk_norm+fp8 final_softcap+fp8 lora+fp8 fp8+muon fp8+state_16bit"
        " chat+state_16bit attention_pattern+state_16bit qk_norm+state_16bit lora+state_16bit"
    ),
    f"{_ORACLES}[grpo-moe-pattern-qknorm-adamw]": ("grpo+attention_pattern"),
    f"{_LOW}[lm-moe-mla-mtp-sinks-softcap-muon+fp16]": ("mla+fp16 mtp+fp16 fp16+muon"),
    f"{_LOW}[chat-moe-sinks-pattern-qknorm-softcap-lora-muon+fp16]": ("chat+fp16 lora+fp16"),
    f"{_LOW}[dpo-moe-sinks-pattern-qknorm-softcap-adamw+bf16+fp8]": ("dpo+bf16 dpo+fp8"),
    f"{_LOW}[grpo-moe-pattern-qknorm-adamw+bf16+fp8]": ("grpo+bf16 grpo+fp8"),
    f"{_LOW}[grpo-moe-pattern-qknorm-adamw+fp16+state16]": ("grpo+fp16 grpo+state_16bit"),
    f"{_ORACLES}[chat-linear-sinks-softcap-muon]": (
        "chat+linear_attention linear_attention+muon final_softcap+linear_attention"
    ),
    f"{_ORACLES}[dpo-linear-qknorm-adamw]": ("dpo+linear_attention linear_attention+adamw"),
    f"{_ORACLES}[grpo-linear-sinks-muon]": ("grpo+linear_attention"),
    f"{_LOW}[chat-linear-sinks-softcap-muon+bf16+state16]": (
        "linear_attention+bf16 linear_attention+state_16bit"
    ),
    f"{_LOW}[dpo-linear-qknorm-adamw+fp16]": ("linear_attention+fp16"),
    f"{_LOW}[dpo-moe-sinks-pattern-qknorm-softcap-adamw+fp16+state16]": (
        "dpo+fp16 moe+fp16 sinks+fp16 attention_pattern+fp16 qk_norm+fp16 final_softcap+fp16"
        " fp16+state_16bit dpo+state_16bit"
    ),
}
# tests that run a few more pairs against a naive forward (tests/reference_llama.py), by hand or
# against the same model with the feature written out (LoRA merged by hand)
_QK_CLIP_CASE = _QK_CLIP_STEP + "[{}]"
_ORACLE_ROWS.update({
    _QK_CLIP_CASE.format("sinks-pattern-softcap"): (
        "sinks+qk_clip attention_pattern+qk_clip final_softcap+qk_clip"
    ),
    _QK_CLIP_CASE.format("moe"): "moe+qk_clip",
    "tests/test_qk_clip.py::test_a_step_on_packed_chat_rows_clips_by_each_documents_own_logits": (
        "chat+qk_clip"
    ),
    _QK_CLIP_CASE.format("bf16"): "bf16+qk_clip",
    _QK_CLIP_CASE.format("fp16"): "fp16+qk_clip",
    _QK_CLIP_CASE.format("fp8"): "fp8+qk_clip",
    _QK_CLIP_CASE.format("state16"): "state_16bit+qk_clip",
    _MLA_CLIP: "dense+mla",
    "tests/test_model.py::test_sinks_qk_norm_layer_pattern_and_softcap_match_the_reference": (
        "dense+sinks sinks+qk_norm sinks+final_softcap qk_norm+final_softcap"
    ),
    "tests/test_mtp.py::test_loss_and_gradients_match_the_reference[mla]": "mla+mtp",
    "tests/test_mtp.py::test_loss_and_gradients_match_the_reference[sinks-qknorm-pattern]": (
        "mtp+sinks mtp+qk_norm mtp+attention_pattern"
    ),
    "tests/test_lora.py::test_adapters_beside_every_layer_feature_equal_the_weights_merged_by_hand": (
        "moe+lora mtp+lora sinks+lora attention_pattern+lora qk_norm+lora final_softcap+lora"
    ),
})  # fmt: skip
for _test, _pairs in _ORACLE_ROWS.items():
    for _a, _b in (p.split("+") for p in _pairs.split()):
        if _b in TABLE.get(_a, {}) or _a in TABLE.get(_b, {}):
            raise ValueError(f"jaxtrain/compose.py TABLE: {_a}+{_b} written twice")
        TABLE.setdefault(_a, {})[_b] = Tested(_test)


NAMES = tuple(f.name for f in FEATURES)
BY_NAME = {f.name: f for f in FEATURES}


def pair(a: str, b: str) -> tuple[str, str]:
    """The pair in FEATURES order (the table's key)."""
    return (a, b) if NAMES.index(a) < NAMES.index(b) else (b, a)


def _pairs_of(table: dict) -> dict[tuple[str, str], Tested | Refused]:
    """TABLE flattened; a pair written twice, an unknown name or a pair of one group is an error
    here (at import), not a silent overwrite."""
    out: dict[tuple[str, str], Tested | Refused] = {}
    for a, row in table.items():
        for b, status in row.items():
            if a not in BY_NAME or b not in BY_NAME:
                raise ValueError(f"jaxtrain/compose.py TABLE: unknown feature in {a}+{b}")
            if BY_NAME[a].group is not None and BY_NAME[a].group == BY_NAME[b].group:
                raise ValueError(f"jaxtrain/compose.py TABLE: {a}+{b} are values of one key, never a pair")
            key = pair(a, b)
            if key in out:
                raise ValueError(f"jaxtrain/compose.py TABLE: {a}+{b} written twice")
            out[key] = status
    return out


# the table's own entries first; the rows of tests/test_pairs.py for every pair they leave
PAIRS = _pairs_of(TABLE)
PAIRS.update({p: t for p, t in _rows().items() if p not in PAIRS})


def all_pairs() -> list[tuple[str, str]]:
    """Every pair of features that can be on together, in FEATURES order."""
    return [
        (a.name, b.name)
        for a, b in itertools.combinations(FEATURES, 2)
        if a.group is None or a.group != b.group
    ]


def status(a: str, b: str) -> Tested | Refused | Untested:
    return PAIRS.get(pair(a, b), Untested())


def active(cfg: Config) -> list[str]:
    """The features `cfg` switches on, in FEATURES order."""
    return [f.name for f in FEATURES if f.on(cfg)]


def active_pairs(cfg: Config) -> list[tuple[str, str]]:
    return list(itertools.combinations(active(cfg), 2))


def refusals(cfg: Config) -> list[str]:
    """The one-line reason of each refused pair `cfg` switches on (config.validate raises the first)."""
    return [s.message(cfg) for p in active_pairs(cfg) if isinstance(s := status(*p), Refused)]


def untested(cfg: Config) -> list[str]:
    """The pairs `cfg` switches on that no test has run together yet, as `a+b`."""
    return [f"{a}+{b}" for a, b in active_pairs(cfg) if isinstance(status(a, b), Untested)]


_warned: set[tuple[str, ...]] = set()


def warn_untested(cfg: Config) -> None:
    """One warning line naming the config's untested pairs (once per process and set of pairs:
    the planner validates many candidates)."""
    pairs = tuple(untested(cfg))
    if pairs and pairs not in _warned:
        _warned.add(pairs)
        _log.warning(
            "%d feature pair(s) of this config never run together by a test (accepted; "
            "docs/composition.md): %s",
            len(pairs),
            ", ".join(pairs),
        )


def counts() -> dict[str, int]:
    every = [status(*p) for p in all_pairs()]
    return {kind.__name__: sum(isinstance(s, kind) for s in every) for kind in (Tested, Refused, Untested)}


# --- docs/composition.md --------------------------------------------------------------------------


def minimal_overrides(*names: str) -> list[str]:
    """The overrides of configs/tiny.yaml that switch on these features (later ones win)."""
    return [o for n in names for o in BY_NAME[n].minimal]


def docs_markdown(example: Callable[[list[str]], Config]) -> str:
    """docs/composition.md. `example(overrides)`: the config of configs/tiny.yaml with those
    overrides (not validated), whose message each refused pair shows."""
    n = counts()
    lines = [
        "# What works with what",
        "",
        "<!-- generated by `python -m jaxtrain.compose_page` from jaxtrain/compose.py: edit it there -->",
        "",
        "Every feature a config can switch on, and for each pair of them either the test that runs",
        "the two together against an oracle (one device, torch, transformers, hand values), or the",
        "one line with which `jaxtrain train` refuses them before anything compiles (exit 2).",
        "Pairs no test has run together yet are accepted; validation names them in one warning line.",
        "Values of one key (the objectives, the pipeline schedules, the compute dtypes, the",
        "optimizers, dense or MoE) are never on together and form no pair.",
        "",
        f"**{len(all_pairs())} pairs: {n['Tested']} tested, {n['Refused']} refused, "
        f"{n['Untested']} not yet run together.**",
        "",
        "## The features",
        "",
        "| Feature | Switched on by (over configs/tiny.yaml) |",
        "|---|---|",
    ]
    for f in FEATURES:
        on = ", ".join(f"`{o}`" for o in f.minimal) or "the default"
        if f.name == "chat":
            on += " (a directory written by `jaxtrain tokenize --chat`)"
        lines.append(f"| `{f.name}` | {on} |")
    lines += ["", "## Refused", "", "| Pair | The error |", "|---|---|"]
    for a, b in all_pairs():
        s = status(a, b)
        if isinstance(s, Refused):
            message = s.message(example(minimal_overrides(a, b))).replace("|", "\\|")
            lines.append(f"| `{a}` + `{b}` | {message} |")
    lines += ["", "## Tested", "", "| Pair | Test |", "|---|---|"]
    for a, b in all_pairs():
        s = status(a, b)
        if isinstance(s, Tested):
            lines.append(f"| `{a}` + `{b}` | `{s.test}` |")
    lines += ["", "## Not yet run together", ""]
    for f in FEATURES:
        others = [b for a, b in all_pairs() if a == f.name and isinstance(status(a, b), Untested)]
        if others:
            lines.append(f"- `{f.name}` with " + ", ".join(f"`{b}`" for b in others))
    if not n["Untested"]:
        lines.append("None: every pair is tested or refused (tests/test_compose.py holds it so).")
    return "\n".join(lines) + "\n"
