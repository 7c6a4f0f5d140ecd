"""The training loop: mesh -> sharded state -> steps -> metrics.

The loop never waits on the device except at logging steps (`logging.every`),
where it fetches the step's metrics; step time is the wall time between two
logging points divided by the steps in between.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import yaml

import sharding
from jaxtrain.config import Config, to_dict
from jaxtrain.data import make_data_iterator
from jaxtrain.flops import flops_per_token, peak_flops_per_device
from jaxtrain.metrics import MetricsWriter
from jaxtrain.train_step import TrainProgram, batch_to_device, build_program


@dataclasses.dataclass
class TrainResult:
    metrics: list[dict]
    state: object
    program: TrainProgram
    mesh: jax.sharding.Mesh


def make_mesh(cfg: Config) -> jax.sharding.Mesh:
    return sharding.make_mesh(cfg.mesh.sizes())


def train(cfg: Config, *, devices=None) -> TrainResult:
    mesh = sharding.make_mesh(cfg.mesh.sizes(), devices)
    rules = sharding.PRESETS[cfg.mesh.rules]
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    flops_per_step = flops_per_token(cfg.model, cfg.train.seq_len) * tokens_per_step
    peak, peak_source = peak_flops_per_device(mesh.devices.flat[0], cfg.logging.peak_flops_per_device)
    # Simulated CPU devices share one host: the measured matmul peak is the whole host's.
    peak_total = peak if (peak_source == "measured matmul") else peak * mesh.size

    data = make_data_iterator(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len,
                              global_batch_size=cfg.train.global_batch_size, seed=cfg.seed,
                              process_index=jax.process_index(), process_count=jax.process_count())
    history: list[dict] = []
    with jax.set_mesh(mesh), sharding.axis_rules(rules), MetricsWriter(
            out, total_steps=cfg.train.steps, tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress) as writer:
        program = build_program(cfg, mesh, rules)
        writer.log(f"mesh {dict((k, v) for k, v in mesh.shape.items() if v > 1) or 'single device'} "
                   f"rules={cfg.mesh.rules} params={cfg.model.param_count():,} "
                   f"peak={peak_total:.3g} FLOP/s ({peak_source})")
        state = program.init()
        batch = batch_to_device(next(data), program.batch_sharding)
        t0 = time.perf_counter()
        step_fn = program.step.lower(state, batch).compile()
        writer.log(f"compiled train step in {time.perf_counter() - t0:.1f} s")
        last_time, last_step = time.perf_counter(), 0
        for step in range(1, cfg.train.steps + 1):
            state, metrics = step_fn(state, batch)
            if step < cfg.train.steps:
                batch = batch_to_device(next(data), program.batch_sharding)  # overlaps the step
            if step % cfg.logging.every == 0 or step == cfg.train.steps:
                metrics = jax.device_get(metrics)   # the loop's only host sync
                now = time.perf_counter()
                step_time = (now - last_time) / (step - last_step)
                last_time, last_step = now, step
                record = {"step": step, "loss": float(metrics["loss"]),
                          "grad_norm": float(metrics["grad_norm"]), "lr": float(metrics["lr"]),
                          "step_time_s": step_time,
                          "tokens_per_second": tokens_per_step / step_time,
                          "mfu": flops_per_step / step_time / peak_total}
                writer.write(record)
                history.append(record)
    return TrainResult(metrics=history, state=state, program=program, mesh=mesh)
