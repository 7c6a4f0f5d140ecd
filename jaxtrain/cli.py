"""`jaxtrain train CONFIG.yaml [dotted.key=value ...]` (also `python -m jaxtrain`).

Config errors exit with code 2 and one line naming the key, the value and the
expectation, before any backend starts or anything compiles.

Exit codes: 0 done, or preempted (SIGTERM/SIGINT) after saving a checkpoint;
2 bad config or data, or checkpoints that do not fit the run (model shape); 3 the
numerical-fault policy stopped the run; 4 a peer process was lost
(multi-process runs; see jaxtrain/recovery/distributed.py); 5 the checkpoints could not be
read (storage unavailable, credentials, out of memory; retried first, nothing moved: run the
same command again once it is fixed); 70 a bug in jaxtrain (a traceback
and a line asking for a report; every expected failure is one line and exit 2).

`jaxtrain compile CONFIG.yaml [overrides] --target TARGET [--slices N]
[--hosts N --gpus-per-host 8] [--json]` AOT-compiles the train step for a TPU
slice or GPU cluster on this machine (jaxtrain/planning/compile.py): exit 0 it fits,
1 it does not fit (by how much, and which knob would help), 2 config error.
`--mode decode --batch B --max-len L` compiles generation instead (prefill and one
decode step over a KV cache of B x L positions): KV-cache and total memory per device.

`jaxtrain plan CONFIG.yaml [overrides] --target TARGET [--top N] [--apply OUT.yaml]` searches
mesh factorisations, remat policies and microbatch counts for the target, prunes them with an
analytic memory and step-time model and confirms the best N by deviceless compile
(jaxtrain/planning/planner.py); `--apply` writes the winner as a config. Exit 0 a candidate fits,
1 none does, 2 config error.

`jaxtrain convert hf-to-ckpt HF_DIR OUT_DIR` / `ckpt-to-hf CKPT_DIR OUT_DIR` convert
weights tensor by tensor (jaxtrain/interchange/convert.py); `train.init_from=OUT_DIR` trains from them.

`jaxtrain tokenize INPUT... --out DIR --tokenizer byte|tokenizer.json` streams a corpus into
token shards for `data.source: tokens` (jaxtrain/data/tokenize.py); with `--chat --tokenizer
HF_DIR`, conversations rendered with the directory's chat template, and a mask of the
assistant's tokens that the loss then counts alone (jaxtrain/data/chat.py).

`jaxtrain generate SOURCE --prompt TEXT [overrides]` samples from a run config, a training
or converted checkpoint or an HF directory on the configured mesh and streams the text
(jaxtrain/interchange/generate.py); exit 2 on a bad source, prompt, tokenizer or option.

`jaxtrain eval SOURCE [overrides] --tasks T1,T2 [--include-path DIR] [--num-fewshot N]
[--limit N] [--batch-size N|auto] [--apply-chat-template] [--output-path DIR] [--log-samples]
[--max-len N]` runs lm-evaluation-harness tasks on the same sources and meshes, answering as
lm-eval's `hf` backend does (jaxtrain/evaluation.py): lm-eval's table on stdout, its result and
sample files under the output path; exit 2 on a bad source, task or option.

Each command imports its room when it runs (the function-local imports below), so that
`--help`, config errors and `tokenize` never pay for JAX, Flax or Orbax.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

from jaxtrain import host
from jaxtrain.config import ConfigError, load_config, validate, validate_paths
from jaxtrain.data.tokenize import add_tokenize_parser, run_tokenize

EXIT_BUG = 70  # sysexits' EX_SOFTWARE: an internal error, never a bad input
EXIT_UNAVAILABLE = 5  # checkpoints storage or memory would not serve, after retries; nothing moved


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxtrain", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _compile_parser(sub)
    _plan_parser(sub)
    _convert_parser(sub)
    add_tokenize_parser(sub)
    _generate_parser(sub)
    _eval_parser(sub)
    return p


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
    c.add_argument(
        "--mode",
        choices=("train", "decode"),
        default="train",
        help="train: the train step (default); decode: generation's prefill and one decode step "
        "with a KV cache of --batch x --max-len (KV-cache and total memory per device)",
    )
    c.add_argument("--batch", type=int, default=None, help="decode: sequences decoded together")
    c.add_argument("--max-len", type=int, default=None, help="decode: KV-cache positions per sequence")
    c.add_argument(
        "--prompt-len", type=int, default=None, help="decode: prefill prompt length (default --max-len)"
    )


def _plan_parser(sub) -> None:
    c = sub.add_parser(
        "plan",
        help="search mesh, remat and microbatches for a target: analytic pruning, then deviceless "
        "compiles of the best; --apply writes the winner as a config",
    )
    c.add_argument("config", help="YAML config file (see configs/)")
    c.add_argument("overrides", nargs="*", help="dotted.key=value overrides (fixed during the search)")
    c.add_argument("--target", required=True, help="tpu:v5p-64, gpu:h100, ... (one slice / host group)")
    c.add_argument("--gpus-per-host", type=int, default=None, help="GPU target: GPUs (default 8)")
    c.add_argument("--top", type=int, default=3, help="candidates confirmed by compile (default 3)")
    c.add_argument(
        "--apply", metavar="OUT.yaml", default=None, help="write the winning config here (a new file)"
    )
    c.add_argument(
        "--force", action="store_true", help="--apply may replace an existing file (never the input)"
    )
    c.add_argument(
        "--hbm-gib", type=float, default=None, help="device memory to plan for instead of the chip's HBM"
    )
    c.add_argument("--headroom", type=float, default=0.9, help="analytic estimate must fit HBM x this")
    c.add_argument(
        "--no-compile", dest="compile", action="store_false", help="analytic model only, no compiles"
    )
    c.add_argument(
        "--kernels-uncharged",
        dest="charge_kernels",
        action="store_false",
        help="as `jaxtrain compile --kernels-uncharged` (attention left out of the TPU estimate)",
    )
    c.add_argument("--show-rejected", type=int, default=12, help="rejected candidates listed (default 12)")


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
    v.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    v.add_argument(
        "--adapter",
        action="store_true",
        help="ckpt-to-hf of a LoRA run: its adapters as a PEFT adapter directory (default: the merged model)",
    )
    v.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "fp8-block"),
        default="float32",
        help="ckpt-to-hf: the weights' dtype; fp8-block: DeepSeek-V3's published layout (e4m3 projections "
        "with a float32 weight_scale_inv per 128x128 block, the rest bfloat16) (default: float32)",
    )


def _generate_parser(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="sample text from a run config, a training or converted checkpoint or an HF directory, "
        "streamed as it is generated",
    )
    g.add_argument(
        "source",
        help="run config (YAML: its newest checkpoint), training checkpoint (step dir, checkpoint.dir "
        "or output_dir), converted checkpoint (model.yaml) or Hugging Face directory (config.json)",
    )
    g.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. mesh.tensor=2")
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", help="a UTF-8 file whose whole contents are the prompt")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with mass p")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (the same on any mesh)")
    g.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="context positions, prompt included (default: the run's train.seq_len, an HF "
        "model's max_position_embeddings)",
    )
    g.add_argument(
        "--tokenizer", default=None, help="byte | tokenizer.json (default: the run's, or the directory's)"
    )
    g.add_argument(
        "--random-init",
        action="store_true",
        help="a run config without a checkpoint: sample from its random initialisation (a smoke test)",
    )


def _eval_parser(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="run lm-evaluation-harness tasks on a run config, a training or converted checkpoint or an "
        "HF directory, on its mesh; lm-eval's table, result and sample files",
    )
    e.add_argument("source", help="as for `jaxtrain generate`: run config, checkpoint or HF directory")
    e.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. mesh.tensor=2")
    e.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    e.add_argument("--include-path", default=None, help="a folder of task YAMLs of your own")
    e.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt")
    e.add_argument(
        "--limit", default=None, help="documents per task: a count, or a fraction of them (< 1); for tests"
    )
    e.add_argument(
        "--batch-size", default="1", help="requests per batch, or auto (about 16k tokens per batch)"
    )
    e.add_argument(
        "--apply-chat-template", action="store_true", help="render prompts with the tokenizer's chat template"
    )
    e.add_argument("--output-path", default=None, help="where lm-eval writes results_*.json (and samples)")
    e.add_argument(
        "--log-samples",
        action="store_true",
        help="also write each request and answer (samples_<task>_*.jsonl)",
    )
    e.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="context positions (default: the run's train.seq_len, an HF model's max_position_embeddings)",
    )
    e.add_argument(
        "--tokenizer", default=None, help="byte | tokenizer.json (default: the run's, or the directory's)"
    )
    e.add_argument("--seed", type=int, default=1234, help="sampling and few-shot seed (lm-eval's default)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with dotted overrides before or after the options alike
    (`jaxtrain compile CFG --target gpu:h100 --hosts 2 train.global_batch_size=64`):
    argparse ends the `overrides` positional at the first option, so the key=value words
    left after the options are put back with the others. Anything else left over is
    refused as argparse would (exit 2, usage)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    commands = {
        "train": lambda: _train(args, argv),
        "compile": lambda: _compile(args),
        "plan": lambda: _plan(args),
        "convert": lambda: _convert(args),
        "tokenize": lambda: run_tokenize(args),
        "generate": lambda: _generate(args),
        "eval": lambda: _eval(args),
    }
    try:
        return commands[args.command]()
    except host.UnknownSettingError as e:  # from configure_host, before any work
        return _fail(str(e))
    except Exception:  # noqa: BLE001 - the CLI boundary: printed with its traceback, exit 70
        # Expected failures (bad config, data, paths, checkpoints) were mapped to one line and
        # exit 2 where they entered; anything reaching here is a bug in jaxtrain.
        traceback.print_exc()
        print(
            f"jaxtrain: internal error in `jaxtrain {args.command}`: the traceback above is a bug in "
            "jaxtrain, not a problem with your input; please report it with the command you ran",
            file=sys.stderr,
        )
        return EXIT_BUG


def _train(args, argv: list[str]) -> int:
    """`jaxtrain train`: config, then the job (multi-process: supervisor + worker), then the loop."""
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return _fail(str(e))
    host.configure_host()  # platform first (before the backend starts), device count below
    # the run's rooms (jax, flax, orbax): imported once the config is known to be good
    from jaxtrain.recovery import distributed

    # Multi-process: this process becomes a supervisor around the worker that trains,
    # so that a lost coordinator is reported by name (jaxtrain/recovery/distributed.py).
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
    host.configure_host((cfg.mesh_size // processes) if cfg.mesh_size else None)
    try:
        _check_train_config(cfg)
    except ConfigError as e:
        return _fail(str(e))
    return _run_training(cfg, distributed)


def _check_train_config(cfg) -> None:
    """Everything `jaxtrain train` can refuse before it builds anything: the config against the
    devices, its paths, `train.init_from`, and sizes that cannot fit (refused in a second,
    not after compiling). Raises ConfigError."""
    # jax and the rooms: imported once the config has loaded, so a bad one fails in a moment
    import jax

    from jaxtrain.interchange.convert import resolve_checkpoint
    from jaxtrain.models.hf import HFConversionError
    from jaxtrain.planning.footprint import check_fits
    from jaxtrain.sharding.mesh import mesh_shape_from_sizes

    validate(cfg, num_devices=jax.device_count())
    validate_paths(cfg)
    if cfg.train.init_from:
        try:
            resolve_checkpoint(cfg.train.init_from)
        except (HFConversionError, FileNotFoundError) as e:
            raise ConfigError(f"train.init_from={cfg.train.init_from!r}: {e}") from None
    # The whole mesh: per-slice (ICI) degrees times the DCN ones (mesh.dcn_*).
    dcn = cfg.mesh.dcn_sizes()
    ici = mesh_shape_from_sizes(cfg.mesh.sizes(), jax.device_count() // math.prod(dcn.values()))
    check_fits(cfg, {a: n * dcn.get(a, 1) for a, n in ici.items()}, jax.devices()[0])


def _run_training(cfg, distributed) -> int:
    """The loop, with its failures mapped to exit codes (module docstring)."""
    # the run's rooms (flax, optax, orbax): imported only by a `train` that got this far
    from jaxtrain.data import DataError
    from jaxtrain.recovery.checkpoint import CheckpointError, CheckpointUnavailableError
    from jaxtrain.recovery.faults import TrainingFault
    from jaxtrain.trainer import train

    try:
        result = train(cfg)
    except CheckpointUnavailableError as e:
        distributed.finish()
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (ConfigError, DataError, CheckpointError) as e:  # ConfigError: a setting resolution refused
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
    """`jaxtrain compile`: deviceless AOT compile of the train step or of generation."""
    # Compile-only devices need no backend but CPU; the CUDA plugin drops out without this.
    os.environ["JAX_PLATFORMS"] = "cpu"
    # the planning room (jax, the deviceless targets): imported for this command only
    from jaxtrain.planning import compile as deviceless
    from jaxtrain.planning import report
    from jaxtrain.planning.decode import compile_decode_report
    from jaxtrain.sharding.targets import DevicelessUnavailableError

    try:
        cfg = load_config(args.config, args.overrides)
        target = deviceless.parse_target(
            args.target, slices=args.slices, hosts=args.hosts, gpus_per_host=args.gpus_per_host
        )
        if args.mode == "train":  # mesh and batch checks before anything compiles
            deviceless.config_for_target(cfg, target)
        if args.mode == "decode" and (args.batch is None or args.max_len is None):
            raise ConfigError("--mode decode: expected --batch B and --max-len L")
        if args.mode == "decode":
            result = compile_decode_report(
                cfg, target, batch=args.batch, max_len=args.max_len, prompt_len=args.prompt_len
            )
        else:
            result = deviceless.compile_report(
                cfg, target, estimate=args.estimate, charge_kernels=args.charge_kernels
            )
    except (ConfigError, DevicelessUnavailableError) as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(result, default=float))
    else:
        print(report.format_decode_report(result) if args.mode == "decode" else report.format_report(result))
    return 0 if result["fits"] else 1


def _plan(args) -> int:
    """`jaxtrain plan`: search, prune, compile the best, print the table (planning/planner.py)."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # compile-only devices, as `jaxtrain compile`
    # the planning room (jax, the deviceless targets): imported for this command only
    from jaxtrain.planning import planner
    from jaxtrain.planning.compile import parse_target
    from jaxtrain.sharding.targets import DevicelessUnavailableError

    try:
        cfg = load_config(args.config, args.overrides)
        target = parse_target(args.target, gpus_per_host=args.gpus_per_host)
        _check_plan_options(args)
        if args.apply:  # before the search, which can take minutes
            planner.check_output(args.apply, args.config, force=args.force)
        result = planner.plan(
            cfg,
            target,
            top=args.top,
            hbm_bytes=None if args.hbm_gib is None else int(args.hbm_gib * 2**30),
            headroom=args.headroom,
            compile=args.compile,
            charge_kernels=args.charge_kernels,
            log=lambda m: print(f"plan: {m}", file=sys.stderr, flush=True),
        )
    except (ConfigError, DevicelessUnavailableError) as e:
        return _fail(str(e))
    print(planner.format_plan(result, show_rejected=args.show_rejected))
    if result.best is None:
        return 1
    if args.apply:
        planner.write_config(cfg, result.best.candidate, args.apply, source=args.config, force=args.force)
        print(
            f"wrote {args.apply}: "
            + " ".join(f"{k}={v}" for k, v in result.best.candidate.overrides().items())
        )
    return 0


def _check_plan_options(args) -> None:
    if args.top < 1:
        raise ConfigError(f"--top={args.top}: expected a positive integer")
    if not 0 < args.headroom <= 1:
        raise ConfigError(f"--headroom={args.headroom}: expected a fraction in (0, 1]")
    if args.hbm_gib is not None and args.hbm_gib <= 0:
        raise ConfigError(f"--hbm-gib={args.hbm_gib}: expected a positive number")


def _convert(args) -> int:
    """`jaxtrain convert`: streaming weight conversion (interchange/convert.py); exit 2 on a bad input."""
    host.configure_host()
    # the interchange room (jax, safetensors, orbax): imported for this command only
    from jaxtrain.interchange import convert
    from jaxtrain.models.hf import HFConversionError

    if args.direction == "hf-to-ckpt" and args.dtype != "float32":
        return _fail(f"--dtype {args.dtype}: applies to ckpt-to-hf (hf-to-ckpt writes float32)")
    try:
        if args.direction == "hf-to-ckpt":
            cfg = convert.hf_to_ckpt(args.source, args.dest, force=args.force)
            print(
                f"converted {args.source} -> {args.dest} ({cfg.param_count():,} parameters); "
                f"train from it with train.init_from={args.dest}"
            )
        else:
            out = convert.ckpt_to_hf(
                args.source,
                args.dest,
                architecture=args.architecture,
                force=args.force,
                adapter=args.adapter,
                dtype=args.dtype,
            )
            kind = "a PEFT LoRA adapter" if args.adapter else "Hugging Face safetensors"
            print(f"converted {args.source} -> {out} ({kind})")
    except (HFConversionError, FileNotFoundError) as e:
        return _fail(str(e))
    return 0


def _generate(args) -> int:
    """`jaxtrain generate`: the source, its mesh (simulated on a CPU host), then the text,
    streamed to stdout (interchange/generate.py); exit 2 on a bad input."""
    # the interchange room; generate.py imports jax only inside, after configure_host
    from jaxtrain.data import DataError
    from jaxtrain.interchange import generate
    from jaxtrain.models.hf import HFConversionError
    from jaxtrain.recovery.checkpoint import CheckpointError

    if args.prompt_file is not None:
        try:
            args.prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            return _fail(f"--prompt-file={args.prompt_file}: {e}")
    write = lambda text: (sys.stdout.write(text), sys.stdout.flush())
    src = None
    try:
        host.configure_host(generate.plan_devices(args.source, args.overrides))  # before the backend starts
        src = generate.open_source(
            args.source, args.overrides, tokenizer=args.tokenizer, random_init=args.random_init
        )
        generate.run(
            src,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            max_len=args.max_len,
            write=write,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (generate.GenerateError, ConfigError, DataError, HFConversionError, CheckpointError) as e:
        return _fail(str(e))
    finally:
        if src is not None:
            src.close()
    return 0


def _eval(args) -> int:
    """`jaxtrain eval`: the source on its mesh (simulated on a CPU host), lm-eval's tasks on it,
    lm-eval's table on stdout and its files under --output-path (jaxtrain/evaluation.py)."""
    from jaxtrain.data import DataError
    from jaxtrain.interchange import generate
    from jaxtrain.models.hf import HFConversionError
    from jaxtrain.recovery.checkpoint import CheckpointError

    try:
        host.configure_host(generate.plan_devices(args.source, args.overrides))  # before the backend starts
        # lm-eval and its datasets: imported for this command only
        from lm_eval.utils import make_table

        from jaxtrain import evaluation

        results = evaluation.run(
            args.source,
            args.overrides,
            tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
            include_path=args.include_path,
            num_fewshot=args.num_fewshot,
            limit=evaluation.parse_limit(args.limit),
            batch_size=args.batch_size,
            apply_chat_template=args.apply_chat_template,
            output_path=args.output_path,
            log_samples=args.log_samples,
            max_length=args.max_len,
            tokenizer=args.tokenizer,
            seed=args.seed,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (generate.GenerateError, ConfigError, DataError, HFConversionError, CheckpointError) as e:
        return _fail(str(e))
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


def _fail(message: str) -> int:
    print(f"jaxtrain: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
