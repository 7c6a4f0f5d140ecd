"""`jaxtrain train CONFIG.yaml [dotted.key=value ...]` (also `python -m jaxtrain`).

Config errors exit with code 2 and one line naming the key, the value and the
expectation, before any backend starts or anything compiles.

Exit codes: 0 done, or preempted (SIGTERM/SIGINT) after saving a checkpoint;
2 bad config or data, or checkpoints that do not fit the run (model shape); 3 the
numerical-fault policy stopped the run; 4 a peer process was lost
(multi-process runs; see jaxtrain/distributed.py).

`jaxtrain compile CONFIG.yaml [overrides] --target TARGET [--slices N]
[--hosts N --gpus-per-host 8] [--json]` AOT-compiles the train step for a TPU
slice or GPU cluster on this machine (jaxtrain/compile.py): exit 0 it fits,
1 it does not fit (by how much, and which knob would help), 2 config error.

`jaxtrain convert hf-to-ckpt HF_DIR OUT_DIR` / `ckpt-to-hf CKPT_DIR OUT_DIR` convert
weights tensor by tensor (jaxtrain/convert.py); `train.init_from=OUT_DIR` trains from them.

`jaxtrain tokenize INPUT... --out DIR --tokenizer byte|tokenizer.json` streams a corpus into
token shards for `data.source: tokens` (jaxtrain/data/tokenize.py).
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxtrain", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _compile_parser(sub)
    _convert_parser(sub)
    _tokenize_parser(sub)
    return p


def _tokenize_parser(sub) -> None:
    from jaxtrain.data.tokenize import add_tokenize_parser

    add_tokenize_parser(sub)


def _train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model from a YAML config")
    t.add_argument("config", help="YAML config file (see configs/)")
    t.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. mesh.fsdp=2")


def _compile_parser(sub) -> None:
    c = sub.add_parser(
        "compile",
        help="AOT-compile the train step for a TPU slice or GPU cluster "
        "(no accelerator needed): memory per device, FLOPs, collectives, est. MFU; "
        "exit 0 fits, 1 does not fit, 2 config error",
    )
    c.add_argument("config", help="YAML config file (see configs/)")
    c.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    c.add_argument(
        "--target",
        required=True,
        help="tpu:v5p-64, tpu:v5e-256, tpu:v6e-64, tpu:v4-128, ... or gpu:h100 / gpu:a100",
    )
    c.add_argument("--slices", type=int, default=1, help="TPU slices (DCN tier; default mesh.dcn_data)")
    c.add_argument("--hosts", type=int, default=1, help="GPU hosts")
    c.add_argument("--gpus-per-host", type=int, default=None, help="GPUs per host (default 8)")
    c.add_argument("--json", action="store_true", help="print the report as one JSON object")
    c.add_argument(
        "--no-estimate",
        dest="estimate",
        action="store_false",
        help="skip the 1-/2-layer compiles behind the step-time estimate (TPU)",
    )
    c.add_argument(
        "--kernels-uncharged",
        dest="charge_kernels",
        action="store_false",
        help="estimate with the Pallas kernels left out of XLA's cost model, as for "
        "kernels without a cost estimate (MaxText's splash attention): for "
        "like-for-like comparisons; the step time then omits attention",
    )


def _convert_parser(sub) -> None:
    v = sub.add_parser(
        "convert", help="convert weights: hf-to-ckpt HF_DIR OUT_DIR | ckpt-to-hf CKPT_DIR OUT_DIR"
    )
    v.add_argument("direction", choices=("hf-to-ckpt", "ckpt-to-hf"))
    v.add_argument("source", help="Hugging Face directory (hf-to-ckpt) or converted checkpoint (ckpt-to-hf)")
    v.add_argument("dest", help="output directory")
    v.add_argument(
        "--architecture",
        default=None,
        help="ckpt-to-hf: LlamaForCausalLM | MistralForCausalLM | MixtralForCausalLM "
        "(default: from the model)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "train":
        return _train(args, argv)
    if args.command == "compile":
        return _compile(args)
    if args.command == "tokenize":
        return _tokenize(args)
    return _convert(args)


def _tokenize(args) -> int:
    """`jaxtrain tokenize`: corpus files -> token shards (jaxtrain/data/tokenize.py); exit 2 on bad input."""
    from jaxtrain.data.tokenize import run_tokenize

    return run_tokenize(args)


def _train(args, argv: list[str]) -> int:
    """`jaxtrain train`: config, then the job (multi-process: supervisor + worker), then the loop."""
    from jaxtrain.config import ConfigError, load_config, validate

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return _fail(str(e))
    from jaxtrain.platform import configure_host

    configure_host()  # platform first (before jax is imported), device count below
    from jaxtrain import distributed

    # Multi-process: this process becomes a supervisor around the worker that trains,
    # so that a lost coordinator is reported by name (jaxtrain/distributed.py).
    code = distributed.supervise(cfg.distributed, argv)
    if code is not None:
        return code
    # Join a multi-process job before the backend starts; each process then simulates
    # (on CPU) only its share of the mesh's devices.
    try:
        membership = distributed.initialize(cfg.distributed)
    except (RuntimeError, ValueError) as e:
        return _fail(f"distributed: could not join the job ({e})")
    processes = membership.num_processes if membership else 1
    configure_host((cfg.mesh_size // processes) if cfg.mesh_size else None)
    import jax

    from jaxtrain.checkpoint import CheckpointError
    from jaxtrain.data import DataError
    from jaxtrain.faults import TrainingFault

    try:
        validate(cfg, num_devices=jax.device_count())
    except ConfigError as e:
        return _fail(str(e))
    from jaxtrain.trainer import train

    try:
        result = train(cfg)
    except (DataError, CheckpointError) as e:
        distributed.finish()
        return _fail(str(e))
    except TrainingFault as e:
        distributed.finish()
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return 3
    except Exception:
        distributed.wait_for_peer_verdict()  # a lost peer is named (and exits 4) rather than a traceback
        raise
    distributed.finish()
    return _report_training(cfg, result)


def _report_training(cfg, result) -> int:
    """The closing line of `jaxtrain train`: done, nothing to do, or preempted (exit 0)."""
    if result.preempted_by:
        where = (
            f"checkpoint step {result.checkpoint_step} saved"
            if result.checkpoint_step is not None
            else "no checkpoint saved (checkpoint.every=0)"
        )
        print(
            f"preempted: stopped by {result.preempted_by} after step {result.final_step}; {where}; "
            "run the same command again to resume"
        )
        return 0
    if not result.metrics:
        print(f"done: nothing to train, the newest checkpoint is already at step {result.final_step}")
        return 0
    last = result.metrics[-1]
    resumed = f" (resumed from step {result.start_step})" if result.start_step else ""
    print(
        f"done: {cfg.train.steps} steps{resumed}, final loss {last['loss']:.4f}, "
        f"metrics in {cfg.output_dir}/metrics.jsonl"
    )
    return 0


def _compile(args) -> int:
    """`jaxtrain compile`: deviceless AOT compile of the train step (jaxtrain/compile.py)."""
    import json
    import os

    # Compile-only devices need no backend but CPU; the CUDA plugin drops out without this.
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxtrain.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        from jaxtrain.compile import config_for_target, parse_target

        target = parse_target(
            args.target, slices=args.slices, hosts=args.hosts, gpus_per_host=args.gpus_per_host
        )
        config_for_target(cfg, target)  # mesh and batch checks before any backend starts
    except ConfigError as e:
        return _fail(str(e))
    from jaxtrain.compile import compile_report, format_report
    from jaxtrain.sharding.targets import DevicelessUnavailableError

    try:
        report = compile_report(cfg, target, estimate=args.estimate, charge_kernels=args.charge_kernels)
    except (ConfigError, DevicelessUnavailableError) as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(report, default=float))
    else:
        print(format_report(report))
    return 0 if report["fits"] else 1


def _convert(args) -> int:
    """`jaxtrain convert`: streaming weight conversion (jaxtrain/convert.py); exit 2 on a bad input."""
    from jaxtrain.platform import configure_host

    configure_host()
    from jaxtrain import convert
    from jaxtrain.models.hf import HFConversionError

    try:
        if args.direction == "hf-to-ckpt":
            cfg = convert.hf_to_ckpt(args.source, args.dest)
            print(
                f"converted {args.source} -> {args.dest} ({cfg.param_count():,} parameters); "
                f"train from it with train.init_from={args.dest}"
            )
        else:
            out = convert.ckpt_to_hf(args.source, args.dest, architecture=args.architecture)
            print(f"converted {args.source} -> {out} (Hugging Face safetensors)")
    except (HFConversionError, FileNotFoundError) as e:
        return _fail(str(e))
    return 0


def _fail(message: str) -> int:
    print(f"jaxtrain: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
