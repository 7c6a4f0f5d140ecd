"""The run: one training step and the loop around it.

    loop.py       train(cfg): resolve, set up, resume, steps, log, checkpoint, evaluate
    program.py    build_program(cfg, mesh): where the state lives, the jitted functions
    step.py       train_step: forward and loss, gradients over microbatches, update, guard
    loss.py       cross-entropy, plain and chunked
    optimizer.py  the optimizer from config: clipping, AdamW (or Muon and AdamW), the
                  schedule, the weight-decay mask, the state dtype
    muon.py       Muon (torch.optim.Muon's update) on the hidden matrices, as HF's matrices
    qk_clip.py    QK-clip: heads over optimizer.qk_clip.tau scaled after the update
    precision.py  dynamic loss scaling (float16)
    batches.py    host rows -> global device batches
    evaluate.py   held-out eval

`from jaxtrain.trainer import train` is the public entry point. It is looked up on first use
(module `__getattr__`), so that importing one of the modules above does not import the loop
and everything it uses.
"""

__all__ = ["TrainResult", "train"]


def __getattr__(name: str):
    if name in __all__:
        from jaxtrain.trainer import loop  # on first use: see the module docstring

        return getattr(loop, name)
    raise AttributeError(f"module 'jaxtrain.trainer' has no attribute {name!r}")
