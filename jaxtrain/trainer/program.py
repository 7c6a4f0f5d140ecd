"""The sharded training program: where the train state lives on the mesh, and the jitted
functions over it (`build_program`). The step itself is trainer/step.py.

`build_program(cfg, mesh)` takes a resolved config (planning/resolve.py: no `auto` left)
and returns a `TrainProgram`: the state's shardings, a jitted `init` that creates the state
already sharded, the jitted and donated `step`, a jitted `eval_step`, and `loss_and_grads`
for tests and tools. `jaxtrain train` runs it, `jaxtrain compile` lowers the same `step`
for compile-only devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import models, sharding
from jaxtrain.config import Config, ConfigError
from jaxtrain.models import lora
from jaxtrain.models.fp8 import model_meta as fp8_model_meta
from jaxtrain.planning.resolve import axis_rules, check_resolved
from jaxtrain.trainer import step as steps
from jaxtrain.trainer.batches import batch_axes
from jaxtrain.trainer.dpo import holds_reference_copy
from jaxtrain.trainer.optimizer import learning_rate_schedule, make_optimizer
from jaxtrain.trainer.precision import init_loss_scale
from jaxtrain.trainer.step import Offload, StepSpec, TrainState

HOST = "pinned_host"  # where optimizer.offload keeps state (a JAX memory kind)


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """What the loop (and `jaxtrain compile`) needs: shardings and jitted functions."""

    graphdef: nnx.GraphDef
    abstract_params: nnx.State  # ShapeDtypeStructs with Variable metadata
    param_axes: dict  # logical axes per parameter (the whole model: base and adapters)
    state_shardings: TrainState
    batch_sharding: NamedSharding
    init: Callable[[], TrainState]  # jitted; creates the state already sharded
    # jitted (params) -> the state around these parameters (train.init_from: no random init;
    # the parameters are donated, so they are not held twice)
    init_with: Callable[[dict], TrainState]
    step: Callable  # jitted (state, batch) -> (state, metrics); state donated
    loss_and_grads: Callable  # jitted (params, batch) -> (loss, tokens, grads); for tests/tools
    optimizer: optax.GradientTransformation
    # jitted (state, batch) -> (CE sum, counted tokens), f32; state not donated (`eval.*`)
    eval_step: Callable | None = None
    # model.lora: jitted () -> fresh adapters (A kaiming-uniform, B zero), sharded, for a run
    # that starts from train.init_from's base without model.lora.init_from; None without LoRA
    init_adapters: Callable | None = None
    param_shardings: dict | None = None  # the whole parameter tree's (base and adapters)


def pipeline_schedule(cfg: Config) -> sharding.PipelineSchedule | None:
    """The model's pipeline schedule for mesh.stage > 1 (the `pipeline` section); None otherwise."""
    stages = cfg.mesh.stage
    if stages <= 1:
        return None
    p = cfg.pipeline
    return sharding.PipelineSchedule(stages, p.resolved_microbatches(stages), p.repeats, name=p.schedule)


def build_program(cfg: Config, mesh: Mesh, rules: sharding.AxisRules | None = None) -> TrainProgram:
    """The program of resolved config `cfg` on `mesh`, under `rules` (default: the config's,
    planning/resolve.py `axis_rules`). Trace it under the same mesh and rules
    (`jax.set_mesh(mesh)`, `sharding.axis_rules(rules)`), as the loop and `compile` do."""
    check_resolved(cfg)
    rules = axis_rules(cfg) if rules is None else rules
    make_model = lambda: models.Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed))
    graphdef, abstract_params = models.abstract_model(make_model)
    param_axes = models.logical_axes(abstract_params)
    param_shapes = nnx.to_pure_dict(abstract_params)
    param_shardings = sharding.tree_shardings(param_axes, rules, mesh, shapes=param_shapes)
    # What trains: every parameter, or with model.lora the adapters alone; the optimizer (its
    # state, weight decay, clipping) sees only that.
    train_axes, train_shapes, train_shardings = param_axes, param_shapes, param_shardings
    frozen_shardings = None
    if cfg.model.lora is not None:
        train_axes = lora.split(param_axes)[1]
        train_shapes = lora.split(param_shapes)[1]
        frozen_shardings, train_shardings = lora.split(param_shardings)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps, param_axes=train_axes)
    layout = state_layout(cfg, mesh, tx, train_shapes, train_shardings, frozen_shardings)
    to_device, to_host = offload_moves(mesh, cfg.optimizer.offload or cfg.optimizer.offload_params)
    spec = StepSpec(
        cfg=cfg,
        graphdef=graphdef,
        abstract_params=abstract_params,
        optimizer=tx,
        schedule=learning_rate_schedule(cfg.optimizer, cfg.train.steps),
        pipeline=pipeline_schedule(cfg),
        offload=Offload(
            params=cfg.optimizer.offload_params,
            opt_state=cfg.optimizer.offload,
            param_shardings=train_shardings,
            opt_shardings=opt_state_shardings(mesh, tx, train_shapes, layout.opt_device),
            to_device=to_device,
            to_host=to_host,
        ),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = sharding.named_sharding(batch_axes(cfg), rules, mesh)
    return TrainProgram(
        graphdef=graphdef,
        abstract_params=abstract_params,
        param_axes=param_axes,
        state_shardings=layout.state,
        batch_sharding=batch_sharding,
        # each traced under the program's rules, whatever is active where it is called
        init=jax.jit(
            sharding.with_rules(lambda: init_state(cfg, fresh_params(make_model), tx), rules),
            out_shardings=layout.state,
        ),
        init_with=jax.jit(
            sharding.with_rules(lambda params: init_state(cfg, params, tx), rules),
            in_shardings=(param_shardings,),
            out_shardings=layout.state,
            donate_argnums=0,
        ),
        step=jax.jit(
            sharding.with_rules(functools.partial(steps.train_step, spec), rules),
            in_shardings=(layout.state, batch_sharding),
            out_shardings=(layout.state, replicated),
            donate_argnums=0,
        ),
        loss_and_grads=jax.jit(
            sharding.with_rules(functools.partial(steps.loss_and_grads, spec), rules),
            in_shardings=(param_shardings, batch_sharding),
            out_shardings=(replicated, replicated, train_shardings),
        ),
        optimizer=tx,
        eval_step=jax.jit(
            sharding.with_rules(functools.partial(steps.eval_sums, spec), rules),
            in_shardings=(layout.state, batch_sharding),
            out_shardings=(replicated, replicated),
        ),
        init_adapters=None
        if cfg.model.lora is None
        else jax.jit(
            sharding.with_rules(lambda: lora.split(fresh_params(make_model))[1], rules),
            out_shardings=train_shardings,
        ),
        param_shardings=param_shardings,
    )


def state_shapes(program: TrainProgram) -> TrainState:
    """ShapeDtypeStructs of the program's train state (traced around abstract parameters: no
    random initialisation is traced, nothing is allocated)."""
    return jax.eval_shape(program.init_with, nnx.to_pure_dict(program.abstract_params))


def fresh_params(make_model: Callable) -> dict:
    """The model's random initial parameters (traced inside `init`: created sharded)."""
    return nnx.to_pure_dict(nnx.state(make_model(), nnx.Param))


def init_state(cfg: Config, params: dict, tx: optax.GradientTransformation) -> TrainState:
    """A fresh train state around `params` (the whole tree): empty optimizer state and loss
    window (jitted with the state's shardings, so it is created already sharded). With
    model.lora the base goes to `frozen` and the adapters alone to `params`;
    train.objective=dpo without adapters: the frozen reference, a copy of `params`
    (trainer/dpo.py)."""
    frozen = None
    if cfg.model.lora is not None:
        frozen, params = lora.split(params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        loss_window=jnp.full((cfg.faults.spike_window,), jnp.nan, jnp.float32),
        loss_scale=init_loss_scale(cfg.optimizer.loss_scale)
        if cfg.model.compute_dtype == "float16"
        else None,
        fp8=fp8_model_meta(cfg.model) if cfg.model.fp8 else None,
        frozen=frozen,
        reference=jax.tree.map(jnp.copy, params) if holds_reference_copy(cfg) else None,
    )


@dataclasses.dataclass(frozen=True)
class StateLayout:
    state: TrainState  # the train state's shardings (offloaded parts in host memory)
    opt_device: dict  # the param-shaped optimizer leaves' shardings on the device


def state_layout(
    cfg: Config,
    mesh: Mesh,
    tx,
    param_shapes: dict,
    param_shardings: dict,
    frozen_shardings: dict | None = None,
) -> StateLayout:
    """Where each part of the train state lives (`param_*`: the trained parameters; with
    model.lora the adapters, `frozen_shardings` the base's, in device memory).
    optimizer.shard_state (ZeRO-1): the moments are laid out as their params and then split
    over `data` too; XLA reduce-scatters the gradients into them and all-gathers the updates.
    optimizer.offload(_params): the moments (master weights) in pinned host memory; the step
    brings them to the device and its output shardings send the new values back, into the
    donated host buffers."""
    o, m = cfg.optimizer, cfg.model
    moments = param_shardings
    if o.shard_state:
        moments = jax.tree.map(
            lambda s, x: NamedSharding(mesh, sharding.shard_further(s.spec, x.shape, mesh, "data")),
            param_shardings,
            param_shapes,
        )
    replicated = NamedSharding(mesh, PartitionSpec())
    state = TrainState(
        step=replicated,
        params=_in_memory(param_shardings, HOST if o.offload_params else None),
        opt_state=opt_state_shardings(mesh, tx, param_shapes, moments, HOST if o.offload else None),
        loss_window=replicated,
        loss_scale=jax.tree.map(lambda _: replicated, init_loss_scale(o.loss_scale))
        if m.compute_dtype == "float16"
        else None,
        # model.fp8: scales and amax histories, replicated (a few KB per layer)
        fp8=jax.tree.map(lambda _: replicated, jax.eval_shape(lambda: fp8_model_meta(m))) if m.fp8 else None,
        frozen=frozen_shardings,
        # train.objective=dpo: the frozen reference, laid out (and offloaded) as the parameters
        reference=_in_memory(param_shardings, HOST if o.offload_params else None)
        if holds_reference_copy(cfg)
        else None,
    )
    return StateLayout(state=state, opt_device=moments)


def opt_state_shardings(mesh: Mesh, tx, param_shapes: dict, moments: dict, memory_kind: str | None = None):
    """The optimizer state's shardings: param-shaped leaves (Adam's moments, Muon's momentum)
    as `moments`, in `memory_kind`; everything else (counts) replicated. Under
    optax.partition (optimizer.name muon) each part holds the others' leaves as MaskedNode,
    which stay so."""
    replicated = NamedSharding(mesh, PartitionSpec())
    masked = lambda x: isinstance(x, optax.MaskedNode)
    return optax.tree_map_params(
        tx,
        lambda x, s: x if masked(x) else s if memory_kind is None else s.with_memory_kind(memory_kind),
        jax.eval_shape(tx.init, param_shapes),
        moments,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding) or masked(x),
    )


def offload_moves(mesh: Mesh, offload: bool) -> tuple[Callable, Callable]:
    """(to_device(tree, device_shardings), to_host(tree)): how the step moves offloaded state.

    Where the devices have a `pinned_host` memory kind (TPU, GPU, CPU), the state's
    shardings carry it: the step's input and output shardings place the state, so
    to_device is a device_put to the device shardings and to_host does nothing.
    Compile-only GPU devices (`jaxtrain compile`, XLA's GPU topology) describe no
    memory spaces at all, and jaxlib then drops every memory kind from their shardings
    (`NamedSharding.with_memory_kind("pinned_host").memory_kind is None`); there the
    step moves the state itself with `jax.memory.Space` (XLA's host-offload custom
    calls, as the remat offload policies do), which the compiler honours: the donated
    state is host memory in the compiled program's memory stats. Devices that list
    their memories but no `pinned_host` are a config error.
    """
    keep = lambda tree, *_: tree
    if not offload:
        return keep, keep
    device = mesh.devices.flat[0]
    probe = NamedSharding(mesh, PartitionSpec()).with_memory_kind(HOST)
    if probe.memory_kind == HOST:
        return jax.device_put, keep
    if not device.addressable_memories():  # a compile-only device without memory descriptions
        return (
            lambda tree, *_: jax.device_put(tree, jax.memory.Space.Device),
            lambda tree: jax.device_put(tree, jax.memory.Space.Host),
        )
    raise ConfigError(
        f"optimizer.offload: the devices ({device.device_kind}) have no '{HOST}' memory (JAX memory "
        "kinds), so the optimizer state cannot live on the host; set optimizer.offload=false and "
        "optimizer.offload_params=false"
    )


def _in_memory(shardings, memory_kind: str | None):
    """The same shardings in `memory_kind` (None: unchanged, i.e. device memory)."""
    if memory_kind is None:
        return shardings
    return jax.tree.map(
        lambda s: s.with_memory_kind(memory_kind), shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
    )
