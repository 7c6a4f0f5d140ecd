"""Decoder-only transformer with layers stacked on a leading `layers` axis and
run with `jax.lax.scan` (one compiled layer body: compile time on CPU is paid
in every test), each layer wrapped in `jax.checkpoint` per `cfg.remat`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models import cpu_tuning, layer_scan, logit_stats, lora, mtp
from jaxtrain.models.blocks import Block, PatternGroup
from jaxtrain.models.config import MATMUL_NAMES, REMAT_KEPT_NAMES, ModelConfig
from jaxtrain.models.layers import REGION_INPUT_AXES, RESIDUAL_AXES, RMSNorm, param
from jaxtrain.models.masks import softcapped
from jaxtrain.models.moe import STAT_KEYS, MoEBlock
from jaxtrain.sharding import PipelineSchedule, constrain, current_rules, is_vocab_parallel, logical_to_spec

# What the backward pass may keep from the forward pass, per `cfg.remat`: models/config.py
# REMAT_KEPT_NAMES. The names are the `checkpoint_name` tags in models/layers.py and
# models/moe.py. Policies modelled on MaxText's `remat_policy` list.
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"


def remat_policy(cfg: ModelConfig):
    """The `jax.checkpoint` policy for `cfg.remat` (None for "none": no checkpoint at all).

    "auto" is resolved before a train program is built (jaxtrain/planning/resolve.py); a model
    built directly with it (generation, which has no backward pass; tests) keeps everything."""
    cp = jax.checkpoint_policies
    if cfg.remat in ("none", "auto"):
        return None
    if cfg.remat == "full":
        return cp.nothing_saveable
    if cfg.remat == "save_matmuls":  # jax's rule for the matmuls, the names beyond them
        named = cp.save_only_these_names(*(set(REMAT_KEPT_NAMES["save_matmuls"]) - set(MATMUL_NAMES)))
        return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, named)
    if cfg.remat == "offload_matmuls":
        saved, offloaded = REMAT_KEPT_NAMES["offload_matmuls"], MATMUL_NAMES
    elif cfg.remat == "custom":
        saved = tuple(n for n, mode in cfg.remat_custom if mode == "device")
        offloaded = tuple(n for n, mode in cfg.remat_custom if mode == "offload")
    elif cfg.remat in REMAT_KEPT_NAMES:
        return cp.save_only_these_names(*REMAT_KEPT_NAMES[cfg.remat])
    else:
        raise ValueError(f"model.remat={cfg.remat!r}: no policy")  # validate() catches this first
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved),
        names_which_can_be_offloaded=list(offloaded),
        offload_src=OFFLOAD_SRC,
        offload_dst=OFFLOAD_DST,
    )


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.embedding = param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=cfg.init_std, dtype=cfg.param_dtype
        )

        # MoE models: a scan over the dense prefix (`blocks`, first_dense_layers of them),
        # then one over `moe_blocks`, each a group of `moe.every` layers ending in an MoE
        # layer. Two scans (two compiled layer bodies) whatever the depth; dense models
        # keep exactly one stack, `blocks`.
        n_dense = cfg.n_layers if cfg.moe is None else cfg.moe.first_dense_layers
        if n_dense and cfg.scan_pattern:  # scanned in groups of one pattern each
            self.blocks = _stack(PatternGroup, n_dense // cfg.layers_per_group, cfg, rngs)
        elif n_dense:
            self.blocks = _stack(Block, n_dense, cfg, rngs)
        if cfg.moe is not None and cfg.scan_pattern:  # every layer MoE, pattern by pattern
            n_moe = cfg.moe.num_moe_layers(cfg)
            self.moe_blocks = _stack(MoEPatternGroup, n_moe // cfg.layers_per_group, cfg, rngs)
        elif cfg.moe is not None:
            group = MoEBlock if cfg.moe.every == 1 else MoEGroup
            self.moe_blocks = _stack(group, cfg.moe.num_moe_layers(cfg), cfg, rngs)
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(
                rngs,
                (cfg.d_model, cfg.vocab_size),
                ("head_embed", "head_vocab"),
                std=cfg.init_std,
                dtype=cfg.param_dtype,
            )
        if cfg.mtp is not None:  # multi-token prediction (models/mtp.py): training only
            self.mtp = _stack(mtp.MTPLayer, cfg.mtp.depth, cfg, rngs, axis="mtp_depth")

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        return_aux: bool = False,
        fp8: dict | None = None,
        pipeline: PipelineSchedule | None = None,
        lora_key: jax.Array | None = None,
    ):
        """tokens int [batch, seq] -> logits [batch, seq, vocab] (compute dtype).

        `positions` (RoPE) default to 0..seq-1; `segment_ids` (packed documents,
        attention stays within a segment) default to one segment per row.
        `return_aux=True` returns (logits, aux): for MoE models the router losses and
        load statistics averaged over MoE layers (`moe_aux_loss`, `moe_z_loss`,
        `moe_dropped_fraction`, `moe_max_load`; max over layers for the latter) and
        `moe_expert_load` [moe layers, experts]; {} for dense models. Inside
        `logit_stats.recording()` also `attention_max_logit`: {stack: {attention module's path
        in a layer: [layers, heads]}}, each head's largest pre-softmax logit (models/logit_stats.py).
        `fp8` (model.fp8): the fp8 state (models/fp8.py `model_meta`; in training, the
        train state's); None: every matmul in the compute dtype.
        `pipeline` (mesh.stage > 1): run each layer stack as that pipeline schedule
        (sharding/pipeline.py); embedding and head stay outside it. Not with `fp8`.
        `lora_key`: a PRNG key that turns on the adapters' dropout (model.lora.dropout; training
        steps); None: no dropout.
        """
        x, aux = self.hidden(
            tokens,
            positions=positions,
            segment_ids=segment_ids,
            fp8=fp8,
            pipeline=pipeline,
            lora_key=lora_key,
        )
        logits = self.project(x)
        return (logits, aux) if return_aux else logits

    def hidden(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        fp8: dict | None = None,
        pipeline: PipelineSchedule | None = None,
        lora_key: jax.Array | None = None,
        normed: bool = True,
    ) -> tuple[jax.Array, dict]:
        """(final-normed activations [batch, seq, d_model] (compute dtype), aux): the model
        up to the output projection, for losses that apply the head themselves
        (jaxtrain/trainer/loss.py); arguments and aux as `__call__`. `normed=False`: the last
        residual stream before the final norm (multi-token prediction's input)."""
        cfg = self.cfg
        if pipeline is not None and fp8 is not None:
            raise ValueError("pipeline: fp8 state is not supported inside a pipeline")
        if tokens.ndim != 2:
            raise ValueError(f"tokens: expected [batch, seq], got shape {tokens.shape}")
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None and pipeline is not None:  # stages slice every row input
            segment_ids = jnp.ones((b, s), jnp.int32)
        x = self.embed(tokens)

        def run(stack, x, meta, key):
            layer, layer_state = self._layer_fn(stack, pipelined=pipeline is not None)
            n = jax.tree.leaves(layer_state)[0].shape[0]
            keys = None if key is None else jax.random.split(key, n)  # one per scanned layer
            if pipeline is not None:
                # Stages over the mesh axis `stage` (sharding/pipeline.py): each layer sees
                # its microbatch's rows of positions and segment ids.
                return pipeline(
                    lambda state, x, ex: layer(state, None, x, *ex),
                    layer_state,
                    x,
                    (positions, segment_ids),
                    x_spec=_rows_spec(x, pipeline.microbatches),
                )
            # float32 weights used in a narrower compute dtype: their gradients stay in it until
            # the backward loop ends (models/layer_scan.py: the same values, less memory at the peak)
            return layer_scan.scan(
                lambda x, xs, consts: layer(*xs[:2], x, *consts, xs[2]),
                x,
                (layer_state, meta, keys),
                (positions, segment_ids),
                unroll=n if cfg.unrolled_layers else 1,
                compact_grads=cfg.compact_weight_grads,
            )

        if pipeline is not None and lora_key is not None:
            raise ValueError("pipeline: LoRA dropout is not supported inside a pipeline")
        meta = fp8 or {}
        aux = {}
        max_logits = {}  # logit_stats.recording(): per stack, {attention path: [layers, heads]}

        def take_max_logits(stack: str, stats):
            if stats is None or logit_stats.KEY not in stats:
                return stats
            stats = dict(stats)
            found = stats.pop(logit_stats.KEY)
            # pipelines give [layers, microbatches, heads]: the largest over the microbatches
            max_logits[stack] = jax.tree.map(lambda v: v if pipeline is None else jnp.max(v, axis=1), found)
            return stats

        stack_keys = (None, None) if lora_key is None else tuple(jax.random.split(lora_key))
        if hasattr(self, "blocks"):
            x, stats = run(self.blocks, x, meta.get("blocks"), stack_keys[0])
            take_max_logits("blocks", stats)
        if cfg.moe is not None:
            x, stats = run(self.moe_blocks, x, meta.get("moe_blocks"), stack_keys[1])
            stats = take_max_logits("moe_blocks", stats)
            if cfg.scan_pattern:  # [groups, layers per group, ...] -> [layers, ...]
                stats = jax.tree.map(lambda v: v.reshape(-1, *v.shape[2:]), stats)
            if pipeline is None:
                stats = jax.tree.map(lambda v: v[:, None], stats)  # [layers, 1 microbatch, ...]
            aux = _router_stats(stats)
        if max_logits:
            aux[logit_stats.KEY] = max_logits
        return (self.final_norm(x) if normed else x), aux

    def predict_ahead(
        self,
        residual: jax.Array,
        inputs: jax.Array,
        targets: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """Multi-token prediction (model.mtp; models/mtp.py): (head-normed hidden states
        [depth, batch, seq, d_model] whose logits predict tokens t + 2 .. t + depth + 1, the
        prediction blocks' MoE stats stacked on depth, None for dense models). `residual`:
        `hidden(..., normed=False)` of the same rows; `inputs`, `targets` [batch, seq] as
        the batch's; `positions`, `segment_ids` as `hidden` takes them."""
        if self.cfg.mtp is None:
            raise ValueError("predict_ahead: the model has no multi-token prediction (model.mtp is null)")
        b, s = inputs.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        emb = jnp.stack([self.embed(t) for t in mtp.lookahead_tokens(inputs, targets, self.cfg.mtp.depth)])
        return mtp.run(
            self.mtp, residual, emb, positions, segment_ids, cfg=self.cfg, policy=remat_policy(self.cfg)
        )

    def _layer_fn(self, stack, *, pipelined: bool):
        """(layer(state, meta, x, positions, segment_ids, key=None) -> (x, aux), the stack's
        stacked state): one layer of `stack`, with the `model.remat` checkpoint."""
        cfg = self.cfg
        graphdef, layer_state = nnx.split(stack)

        def layer(state, meta, x, positions, segment_ids, key=None):
            module = nnx.merge(graphdef, state)
            with lora.dropout_keys(key), logit_stats.collecting() as seen:
                out = module(x, positions, segment_ids, meta)
            out, stats = out if isinstance(out, tuple) else (out, None)
            return out, logit_stats.layer_output(stats, seen, module)

        if remat_policy(cfg) is not None:
            # Inside a scan XLA cannot CSE the recompute away, and prevent_cse=True would
            # only add barriers; unrolled, it is what keeps the remat a remat.
            layer = jax.checkpoint(
                layer, policy=remat_policy(cfg), prevent_cse=cfg.unrolled_layers and not pipelined
            )
        return layer, layer_state

    def pipelined_loss(
        self,
        tokens: jax.Array,
        loss_fn,
        loss_inputs,
        *,
        pipeline: PipelineSchedule,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        router_weights: tuple[jax.Array, jax.Array] | None = None,
    ):
        """The loss summed over the batch, for a pipeline whose backward runs inside it
        (`pipeline.backward_inside`: 1f1b, interleaved_1f1b, zero_bubble). The layers, the
        final norm and `loss_fn(x, head, rows) -> scalar` (x: final-normed activations of one
        microbatch; head: `self.head()`; rows: that microbatch's rows of the pytree
        `loss_inputs`, e.g. targets and mask) run in the pipeline's tick loop, the loss at the
        last stage; the result is differentiable in the parameters (a custom VJP that has
        computed every gradient in its forward; sharding/tick_pipeline.py).

        MoE models: the MoE stack runs in the tick loop, a dense prefix before it
        (moe.first_dense_layers) as `pipeline`'s forward, differentiated by autodiff
        (GPipe's memory for those layers). `router_weights` (the weights of the mean router
        aux and z losses in the caller's objective) put the router losses' gradients into
        each stage's backward; the result is then (loss, aux as `hidden` gives it), and the
        caller adds `router_weights * aux` to its objective as a constant (its gradient is
        already in the loss's: `sharding.tick_pipeline.pipeline_loss`)."""
        cfg = self.cfg
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None:  # stages slice every row input
            segment_ids = jnp.ones((b, s), jnp.int32)
        x = self.embed(tokens)
        x_spec = _rows_spec(x, pipeline.microbatches)
        extras = (positions, segment_ids)
        stack = self.blocks if cfg.moe is None else self.moe_blocks
        if cfg.moe is not None and hasattr(self, "blocks"):  # the dense prefix
            layer, layer_state = self._layer_fn(self.blocks, pipelined=True)
            x, _ = pipeline(
                lambda state, x, ex: layer(state, None, x, *ex), layer_state, x, extras, x_spec=x_spec
            )
        layer, layer_state = self._layer_fn(stack, pipelined=True)
        norm_graphdef, norm_state = nnx.split(self.final_norm)

        def tail(tail_params, y, rows):
            norm, head = tail_params
            return loss_fn(nnx.merge(norm_graphdef, norm)(y), head, rows)

        aux_weights = None
        if cfg.moe is not None:
            if router_weights is None:
                raise ValueError(
                    "pipelined_loss: an MoE model needs router_weights (its router losses' weights)"
                )
            # the objective weighs the means over MoE layers and microbatches: each layer's
            # loss on each microbatch by 1 / (layers * microbatches) of it
            share = 1.0 / (cfg.moe.num_moe_layers(cfg) * pipeline.microbatches)
            aux_w, z_w = router_weights
            aux_weights = {k: 0.0 for k in (*STAT_KEYS, "expert_load")}
            aux_weights.update(aux_loss=aux_w * share, z_loss=z_w * share)
        out = pipeline.loss(
            lambda state, x, ex: layer(state, None, x, *ex),
            tail,
            layer_state,
            (norm_state, self.head()),
            x,
            extras,
            loss_inputs,
            x_spec=x_spec,
            aux_weights=aux_weights,
        )
        if aux_weights is None:
            return out
        loss, stats = out
        if cfg.scan_pattern:  # [groups, M, layers per group, ...] -> [layers, M, ...]
            stats = jax.tree.map(
                lambda v: jnp.moveaxis(v, 2, 1).reshape(-1, *v.shape[1:2], *v.shape[3:]), stats
            )
        return loss, _router_stats(stats)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens int [batch, seq] -> activations [batch, seq, d_model] (compute dtype)."""
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(jnp.dtype(self.cfg.compute_dtype))
        if self.cfg.embedding_scale != 1.0:  # in the activations' dtype, as Gemma scales
            x = x * jnp.asarray(self.cfg.embedding_scale, x.dtype)
        # The lookup in a vocab-sharded table ends in a reduction over those shards: keep
        # seq whole through it so that XLA reduces the rows (a reduce-scatter into the
        # residual layout) instead of all-gathering the table.
        return constrain(constrain(x, REGION_INPUT_AXES), RESIDUAL_AXES)

    def unembed(self, x: jax.Array) -> jax.Array:
        """Last layer's activations [batch, seq, d_model] -> logits [batch, seq, vocab]."""
        return self.project(self.final_norm(x))

    def project(self, x: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """Final-normed activations [batch, seq, d_model] -> logits [batch, seq, vocab].
        `head`: the output projection to use (default `self.head()`)."""
        # an untied head is stored in this layout; a tied one (the table's transpose) is resharded
        # to it (a no-op unless the head is vocab-parallel)
        head = self.head() if head is None else head
        head = constrain(head, ("head_embed", "head_vocab")).astype(jnp.dtype(self.cfg.compute_dtype))
        # head_batch: the batch's layout, or gathered over fsdp when the head is vocab-parallel
        # (sharding.vocab_parallel_head)
        x = constrain(x, ("head_batch", "seq", "act_embed"))
        if self.cfg.cpu_tuning is True:
            # A vocab-parallel head's weight gradient contracts every gathered row; under
            # autodiff's layout XLA:CPU ran it in bf16 as a slow Eigen dot, so it takes the
            # transpose-free gradient in any dtype (models/cpu_tuning.py).
            rules = current_rules()
            vocab_parallel = rules is not None and is_vocab_parallel(rules)
            logits = cpu_tuning.einsum("...d,dv->...v", x, head, any_dtype=vocab_parallel)
        else:
            logits = jnp.einsum("...d,dv->...v", x, head)
        if self.cfg.final_softcap is not None:  # Gemma 2, in f32
            logits = softcapped(logits.astype(jnp.float32), self.cfg.final_softcap).astype(logits.dtype)
        return constrain(logits, ("head_batch", "seq", "act_vocab"))

    def head(self) -> jax.Array:
        """The output projection [d_model, vocab] (param dtype): lm_head, or the embedding's
        transpose when tied."""
        return self.embedding[...].T if self.cfg.tie_embeddings else self.lm_head[...]


def _router_stats(stats: dict) -> dict:
    """The MoE layers' router statistics `[layers, microbatches, ...]` as `hidden`'s aux: per
    microbatch the mean over layers (max for max_load), then the mean over microbatches,
    as train.microbatches averages them; `moe_expert_load` [layers, experts]."""
    aux = {
        f"moe_{k}": jnp.mean(jnp.max(v, axis=0) if k == "max_load" else jnp.mean(v, axis=0))
        for k, v in stats.items()
        if k != "expert_load"
    }
    aux["moe_expert_load"] = jnp.mean(stats["expert_load"], axis=1)
    return aux


def _rows_spec(x: jax.Array, microbatches: int):
    """The PartitionSpec of one pipeline microbatch of activations x [batch, seq, embed]
    under the active rules (None without rules or a mesh)."""
    rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return None
    shape = (x.shape[0] // microbatches, *x.shape[1:])
    return logical_to_spec(("batch", "seq", "act_embed"), rules, mesh, shape)


def _stack(cls, n: int, cfg: ModelConfig, rngs: nnx.Rngs, axis: str = "layers"):
    """`n` layers of `cls` stacked on a leading axis of logical name `axis` (scanned in
    __call__)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs: nnx.Rngs):
        return cls(cfg, rngs=rngs)

    return make(rngs)


class MoEGroup(nnx.Module):
    """`moe.every` layers: every - 1 dense blocks (`dense_0`, ...), then an MoE block (`moe`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.n_dense = cfg.moe.every - 1
        for i in range(self.n_dense):
            setattr(self, f"dense_{i}", Block(cfg, rngs=rngs))
        self.moe = MoEBlock(cfg, rngs=rngs)

    def __call__(self, x, positions, segment_ids, fp8=None):
        for i in range(self.n_dense):
            x = getattr(self, f"dense_{i}")(
                x, positions, segment_ids, None if fp8 is None else fp8[f"dense_{i}"]
            )
        return self.moe(x, positions, segment_ids, None if fp8 is None else fp8["moe"])


class MoEPatternGroup(PatternGroup):
    """One repeat of `model.attention_pattern` (GPT-OSS: sliding and full alternating) or of
    `model.layer_types` (Qwen3.5-MoE: DeltaNet and full attention) on MoE layers: an MoEBlock
    per kind (`layer_0`, ...); returns (x, each layer's router statistics stacked [pattern
    length, ...])."""

    block = MoEBlock

    def __call__(self, x, positions, segment_ids, fp8=None):
        stats = []
        for i, block in enumerate(self.blocks()):
            x, layer_stats = block(x, positions, segment_ids, None if fp8 is None else fp8[f"layer_{i}"])
            stats.append(layer_stats)
        return x, jax.tree.map(lambda *v: jnp.stack(v), *stats)
