"""An Orbax parameter checkpoint written one HF slice at a time (`convert hf-to-ckpt`).

Why: DeepSeek-V3 is 671B parameters; assembling its stacked float32 arrays on the host before
saving (2.7 TB) is not an option. Each parameter becomes a leaf that Orbax saves with its
usual layout (OCDBT, zarr, `_METADATA`: `StandardCheckpointer` and `train.init_from` restore
it as if `save` had been given numpy arrays), but whose data a custom TypeHandler writes
slice by slice: the TensorStore array is created with one shard per stacked slice (one layer,
or one layer's expert) and each slice is read from the HF directory (models/hf/loader.py
`param_sources`: read, dequantized, converted), written, and dropped before the next. Leaves
are written one after another, so the host holds one slice (and TensorStore's copy of it)
at a time, whatever the model's size.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.serialization import ocdbt_utils, type_handler_registry, type_handlers
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from jaxtrain.models.hf import ParamSource


@dataclasses.dataclass(frozen=True)
class StreamedArray:
    """A leaf whose data is `source`'s slices, cast to `dtype` as they are written."""

    source: ParamSource
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def slice_dims(self) -> int:
        """How many leading (stacking) axes a slice's index covers."""
        return len(self.source.slices[0][0])


class _StreamedHandler(type_handlers.NumpyHandler):
    """Saves StreamedArrays as NumpyHandler saves numpy arrays (same spec, same `np.ndarray`
    type in the metadata, so restoring needs nothing of this), writing slice by slice."""

    def __init__(self):
        super().__init__(deepcopy_host_arrays=False)

    async def _background_serialize(self, values, infos, args=None):
        for value, info, arg in zip(values, infos, args, strict=True):
            await info.await_path_creation()
            k = value.slice_dims
            spec = ts_utils.build_array_write_spec(
                info=info,
                arg=arg,
                global_shape=value.shape,
                local_shape=(1,) * k + value.shape[k:],  # one shard per slice: no read-modify-write
                dtype=value.dtype,
                use_ocdbt=info.is_ocdbt_checkpoint,
                process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
            )
            store = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
            for index, read in value.source.slices:
                await store[index].write(np.asarray(read(), value.dtype))


def save_streamed(
    directory: str | Path, sources: dict[tuple[str, ...], ParamSource], dtype=np.float32
) -> None:
    """Write `sources` (models/hf/loader.py `param_sources`) as the Orbax PyTree checkpoint
    `directory` (replaced if it exists), nested by their paths, in `dtype`."""
    tree: dict = {}
    for path, source in sources.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = StreamedArray(source, np.dtype(dtype))
    registry = type_handler_registry.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler()),  # (unused; Orbax warns without one)
        (StreamedArray, _StreamedHandler()),
    )
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))
    checkpointer.save(directory, args=ocp.args.PyTreeSave(tree), force=True)
    checkpointer.close()
