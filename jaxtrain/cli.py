"""`jaxtrain train CONFIG.yaml [dotted.key=value ...]` (also `python -m jaxtrain`).

Config errors exit with code 2 and one line naming the key, the value and the
expectation, before any backend starts or anything compiles.
"""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxtrain", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a YAML config")
    t.add_argument("config", help="YAML config file (see configs/)")
    t.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. mesh.fsdp=2")
    return p


def _fail(message: str) -> int:
    print(f"jaxtrain: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from jaxtrain.config import ConfigError, load_config, validate

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return _fail(str(e))
    from jaxtrain.platform import configure_host

    configure_host(cfg.mesh_size or None)
    import jax

    from jaxtrain.data import DataError
    try:
        validate(cfg, num_devices=jax.device_count())
    except ConfigError as e:
        return _fail(str(e))
    from jaxtrain.trainer import train

    try:
        result = train(cfg)
    except DataError as e:
        return _fail(str(e))
    last = result.metrics[-1]
    print(f"done: {cfg.train.steps} steps, final loss {last['loss']:.4f}, "
          f"metrics in {cfg.output_dir}/metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
