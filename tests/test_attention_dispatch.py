"""The model's attention dispatcher: `attention_impl=pallas` (the flash kernel in
interpret mode, inside shard_map over batch/heads) trains like `xla`, with packed
multi-document rows. (`auto` is resolved in planning/resolve.py: tests/test_resolve.py.)"""

import json

import jax
import numpy as np

from jaxtrain.trainer import train
from tests.conftest import tiny_config


def test_pallas_trains_like_xla_on_packed_documents(tmp_path):
    docs = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sharding", "mesh", "kernel", "flash"]
    docs.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, 12)))}) + "\n" for _ in range(200)
        )
    )

    def losses(impl):
        cfg = tiny_config(
            tmp_path / impl,
            "model.d_model=64",
            "model.mlp_dim=128",
            "train.seq_len=64",
            "train.steps=3",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "data.source=text",
            f"data.paths=[{docs}]",
            f"model.attention_impl={impl}",
        )
        return [r["loss"] for r in train(cfg, devices=jax.devices()).metrics]

    xla, pallas = losses("xla"), losses("pallas")
    # f32; the kernel's blockwise softmax differs from XLA's only in summation order.
    np.testing.assert_allclose(pallas, xla, rtol=1e-5)


def test_packed_rows_really_hold_several_documents(tmp_path):
    from jaxtrain.data import make_data_iterator

    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"text": f"short doc {i}"}) + "\n" for i in range(50)))
    cfg = tiny_config(None, "data.source=text", f"data.paths=[{docs}]")
    it = make_data_iterator(cfg.data, vocab_size=512, seq_len=64, global_batch_size=2, seed=0)
    assert next(it)["segment_ids"].max() >= 3
