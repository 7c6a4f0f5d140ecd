"""Batches on the mesh: this process's numpy rows -> global `jax.Array`s sharded on the
batch axes, in the step's sequence order, and their abstract shapes for AOT compiles.

A batch is `[batch, seq]` per field; with train.objective=dpo it is `[pairs, 2, seq]`
(chosen, rejected: trainer/dpo.py), sharded on the pairs and never across a pair."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.config import Config
from jaxtrain.sharding.context import permute_batch

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# train.objective=grpo: the rollout's float fields besides (trainer/grpo.py GRPO_KEYS)
GRPO_KEYS = ("advantages", "old_logps", "loss_weight", "token_share")
BATCH_AXES = ("batch", "seq")
PAIR_AXES = ("batch", None, "seq")  # train.objective=dpo: [pairs, 2, seq]


def batch_axes(cfg: Config) -> tuple:
    """The logical axes of the run's batch fields."""
    return PAIR_AXES if cfg.train.objective == "dpo" else BATCH_AXES


def rows_axes(x) -> tuple:
    """The logical axes of one batch field, by its rank ([batch, seq] or [pairs, 2, seq])."""
    return PAIR_AXES if x.ndim == 3 else BATCH_AXES


def batch_to_device(batch: dict, batch_sharding: NamedSharding) -> dict:
    """This process's numpy rows -> global jax.Arrays sharded on the batch axes."""
    keys = [k for k in (*BATCH_KEYS, *GRPO_KEYS) if k in batch]
    return {k: jax.make_array_from_process_local_data(batch_sharding, batch[k]) for k in keys}


def abstract_batch(cfg: Config, batch_sharding: NamedSharding) -> dict:
    """ShapeDtypeStructs of one global batch (for AOT compiles)."""
    t = cfg.train
    shape = (t.global_batch_size, 2, t.seq_len) if t.objective == "dpo" else (t.global_batch_size, t.seq_len)
    dtypes = {"loss_mask": jnp.float32, **dict.fromkeys(GRPO_KEYS, jnp.float32)}
    keys = (*BATCH_KEYS, *GRPO_KEYS) if t.objective == "grpo" else BATCH_KEYS
    return {k: jax.ShapeDtypeStruct(shape, dtypes.get(k, jnp.int32), sharding=batch_sharding) for k in keys}


class BatchFeeder:
    """Global batches on the mesh, in data order: the TESTING HOOK
    `faults.testing_poison_batches` applied, then the zig-zag sequence order of
    context parallelism (load-balanced causal ring)."""

    def __init__(self, cfg: Config, data, mesh: jax.sharding.Mesh, batch_sharding):
        self.data = data
        self.poison = frozenset(cfg.faults.testing_poison_batches)
        self.context = mesh.shape["context"]
        self.batch_sharding = batch_sharding

    def next(self) -> tuple[dict, int]:
        """(device batch, its global batch index)."""
        index = self.data.get_state()["batch"]
        rows = next(self.data)
        if index in self.poison:
            rows = dict(rows, loss_mask=np.full_like(rows["loss_mask"], np.inf))
        return self.place(rows), index

    def place(self, rows: dict) -> dict:
        """This process's rows -> the global device batch, in the step's sequence order."""
        seq_axis = rows["inputs"].ndim - 1  # [batch, seq] or [pairs, 2, seq]
        return batch_to_device(permute_batch(rows, self.context, axis=seq_axis), self.batch_sharding)

    def data_state(self) -> dict:
        """The data position (of the next batch `next` returns), as checkpoints store it."""
        return self.data.get_state()

    def seek(self, data_state: dict) -> None:
        self.data.set_state(data_state)
