"""Batches on the mesh: this process's numpy rows -> global `jax.Array`s sharded on the
batch axes, in the step's sequence order, and their abstract shapes for AOT compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.config import Config
from jaxtrain.sharding.context import permute_batch

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
BATCH_AXES = ("batch", "seq")


def batch_to_device(batch: dict, batch_sharding: NamedSharding) -> dict:
    """This process's numpy rows -> global jax.Arrays sharded on the batch axes."""
    return {k: jax.make_array_from_process_local_data(batch_sharding, batch[k]) for k in BATCH_KEYS}


def abstract_batch(cfg: Config, batch_sharding: NamedSharding) -> dict:
    """ShapeDtypeStructs of one global batch (for AOT compiles)."""
    shape = (cfg.train.global_batch_size, cfg.train.seq_len)
    dtypes = {"loss_mask": jnp.float32}
    return {
        k: jax.ShapeDtypeStruct(shape, dtypes.get(k, jnp.int32), sharding=batch_sharding) for k in BATCH_KEYS
    }


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
        return batch_to_device(permute_batch(rows, self.context), self.batch_sharding)

    def data_state(self) -> dict:
        """The data position (of the next batch `next` returns), as checkpoints store it."""
        return self.data.get_state()

    def seek(self, data_state: dict) -> None:
        self.data.set_state(data_state)
