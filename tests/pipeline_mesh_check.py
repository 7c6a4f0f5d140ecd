"""Run by tests/test_pipeline.py in a subprocess with 32 simulated devices: a pipeline
composed with four other axes (5 axes of size 2 need 32 devices) gives the oracle's loss
and gradients. Prints one line per mesh; exits non-zero on a mismatch."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=32"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tests.conftest import replace  # noqa: E402
from tests.test_pipeline import GRAD_ATOL, GRAD_RTOL, LOSS_RTOL, dense_cfg, loss_and_grads, moe_cfg  # noqa: E402

# Oracles. MoE: one device; router losses are per microbatch, so the oracle splits its
# batch the same way (train.microbatches, a sequential scan). Dense with context: the same
# mesh with `stage` folded into `data` (no pipeline), because context parallelism alone
# already differs from one device by ~2e-4 in the loss on this config (zig-zag ring
# attention sums in another order; tests/test_context_parallel.py allows 1e-4 over its runs),
# so the pipeline is held to adding nothing on top of it.
CASES = {
    "dense": (
        dense_cfg,
        dict(data=2, stage=2, fsdp=2, tensor=2, context=2),
        dict(mesh=dict(data=4, fsdp=2, tensor=2, context=2)),
    ),
    "moe": (
        lambda: replace(moe_cfg(), train=dict(global_batch_size=16)),  # 8-way batch x 2 microbatches
        dict(data=2, stage=2, fsdp=2, tensor=2, expert=2),
        dict(train=dict(microbatches=2, global_batch_size=16)),
    ),
}

for name in sys.argv[1:] or CASES:
    make, mesh, oracle = CASES[name]
    ref_loss, ref_grads = loss_and_grads(replace(make(), **oracle))
    loss, grads = loss_and_grads(replace(make(), mesh=mesh, pipeline=dict(microbatches=2)))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    for path, g in grads.items():
        np.testing.assert_allclose(g, ref_grads[path], rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=path)
    print(name, mesh, "loss", loss, "equals", oracle, ref_loss, flush=True)
