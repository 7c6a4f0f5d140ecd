"""The CLI end to end (subprocess, as a user runs it) and its error contract:
exit code 2 and one line naming key, value and expectation, before any compile."""

import json
import os
import subprocess
import sys

import pytest

from jaxtrain import host
from jaxtrain.cli import main, parse_args
from tests.conftest import REPO, child_env

TINY = os.path.join(REPO, "configs", "tiny.yaml")


def run_cli(*args, env_extra=None):
    # the CLI picks the device count; the machine's own malloc choices stay out of the tests
    env = child_env("LD_PRELOAD", "GLIBC_TUNABLES", host.OPT_OUT)
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "jaxtrain", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )


def test_train_end_to_end_on_a_sharded_mesh(tmp_path):
    out = run_cli(
        "train",
        TINY,
        f"output_dir={tmp_path}",
        "train.steps=4",
        "logging.every=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_second", "mfu"} <= set(r)
        assert r["tokens_per_second"] > 0 and 0 < r["mfu"] < 1
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "config.yaml").is_file()
    assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in out.stderr
    # every `auto` the tiny config leaves is resolved for this CPU host, said once each, and
    # config.yaml records the values (nothing stays auto)
    for line in (
        "model.attention_impl=auto -> xla: ",
        "model.cpu_tuning=auto -> true: ",
        "mesh.head_sharding=auto -> embed: ",
        "train.loss_chunk=auto -> 0: ",
    ):
        assert out.stderr.count(line) == 1, line
    saved = (tmp_path / "config.yaml").read_text()
    assert ": auto\n" not in saved and "cpu_tuning: true" in saved and "attention_impl: xla" in saved
    # a CPU run without malloc settings of the user's gets the tuned glibc heap, in this same
    # process: the CLI does not run itself again (no allocator is preloaded)
    assert "host malloc: one glibc arena" in out.stderr


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["nope=1"], "nope: unknown key"),
        (["model.n_layerz=2"], "model.n_layerz: unknown key"),
        (["train.steps=many"], "train.steps='many': expected an integer"),
        (["model.n_kv_heads=3"], "model.n_kv_heads=3: expected a divisor of model.n_heads=4"),
        (["mesh.tensor=4", "model.n_kv_heads=2"], "model.n_kv_heads=2: expected a multiple of mesh.tensor=4"),
        (["mesh.tensor=8"], "model.n_heads=4: expected a multiple of mesh.tensor=8"),
        (["train.seq_len=0"], "train.seq_len=0: expected a positive integer"),
        (
            ["model.param_dtype=float16"],
            "model.param_dtype='float16': master weights must stay float32 (or bfloat16); "
            "for fp16 training set model.compute_dtype=float16 (dynamic loss scaling)",
        ),
        (
            ["optimizer.loss_scale.backoff_factor=2"],
            "optimizer.loss_scale.backoff_factor=2.0: expected in (0, 1)",
        ),
        (["mesh.data=8", "train.global_batch_size=12"], "train.global_batch_size=12: expected a multiple of"),
        (["mesh.data=2", "train.microbatches=3", "train.global_batch_size=8"], "train.global_batch_size=8"),
        (["mesh.data=3"], "mesh: product 3 (data=3) does not equal the device count 8"),
        # a GPU-only attention for this CPU program: refused at resolution, before any build
        (
            ["mesh.data=8", "model.attention_impl=cudnn", "model.compute_dtype=bfloat16"],
            "model.attention_impl=cudnn: cuDNN's fused attention runs only on NVIDIA GPUs, and this "
            "program runs on CPU; expected xla or auto",
        ),
        (
            [
                "mesh.data=8",
                "model.attention_impl=pallas_mosaic",
                "model.compute_dtype=bfloat16",
                "model.head_dim=64",
            ],
            "model.attention_impl=pallas_mosaic: the Hopper flash kernel (Pallas Mosaic GPU) runs only on "
            "Hopper GPUs, and this program runs on CPU",
        ),
        (["mesh.data=8", "data.source=text", "data.paths=[/nonexistent/file.txt]"], "/nonexistent/file.txt"),
        (
            [
                "mesh.data=8",
                "data.source=text",
                "data.paths=[" + os.path.join(REPO, "README.md") + "]",
                "model.vocab_size=100",
            ],
            "model.vocab_size",
        ),
    ],
)
def test_config_errors_exit_2_with_one_line(capsys, overrides, expected):
    # In-process: the test process already has 8 CPU devices, so "mesh product != device
    # count" is reachable; a compile would take seconds, these return at once.
    code = main(["train", TINY, "logging.progress=false", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("jaxtrain: error: "), err
    assert expected in err[0], err[0]


def test_subprocess_config_error_is_one_line_and_fast():
    out = run_cli("train", TINY, "model.n_kv_heads=3")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "jaxtrain: error: model.n_kv_heads=3: expected a divisor of model.n_heads=4"
    ]


def test_a_misspelt_host_malloc_setting_is_one_line_before_any_work():
    out = run_cli("train", TINY, env_extra={"JAX_PLATFORMS": "cpu", "JAXTRAIN_HOST_MALLOC": "sytem"})
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("jaxtrain: error: JAXTRAIN_HOST_MALLOC='sytem': expected one of system, off, 0")


def test_overrides_may_follow_the_options(capsys):
    """The presets' headers write `compile CFG --target T --hosts 2 key=value`: overrides
    after the options join those before them, in order; stray words still exit 2."""
    cfg = "configs/llama2-7b.yaml"
    before = parse_args(["compile", cfg, "mesh.fsdp=2", "--target", "gpu:h100", "--hosts", "2", "a.b=1"])
    assert before.overrides == ["mesh.fsdp=2", "a.b=1"] and before.hosts == 2 and before.target == "gpu:h100"
    after = parse_args(["compile", cfg, "--target", "gpu:h100", "mesh.fsdp=2", "a.b=1"])
    assert after.overrides == ["mesh.fsdp=2", "a.b=1"]
    for stray in ("--no-such-flag", "notakeyvalue"):
        with pytest.raises(SystemExit) as e:
            parse_args(["compile", cfg, "--target", "gpu:h100", stray])
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_missing_config_file():
    out = run_cli("train", "no/such.yaml")
    assert out.returncode == 2 and "no/such.yaml" in out.stderr


def test_text_demo_config_trains_on_local_files(tmp_path):
    """configs/tiny-text.yaml: packed byte-level documents from the repo's own sources."""
    import jax

    from jaxtrain.config import load_config
    from jaxtrain.trainer import train

    cfg = load_config(
        os.path.join(REPO, "configs", "tiny-text.yaml"),
        [
            f"output_dir={tmp_path}",
            "train.steps=3",
            "logging.progress=false",
            "logging.tensorboard=false",
            "data.paths=[" + ",".join(os.path.join(REPO, p) for p in ("README.md", "jaxtrain/*.py")) + "]",
        ],
    )
    losses = [r["loss"] for r in train(cfg, devices=jax.devices()[:1]).metrics]
    assert len(losses) == 3 and all(l == l for l in losses)  # finite
    # untrained model: loss near log(vocab) over the counted tokens
    assert abs(losses[0] - __import__("math").log(cfg.model.vocab_size)) < 0.5


def test_configure_host_pins_cpu_and_sets_device_count():
    code = (
        "from jaxtrain.host import configure_host; configure_host(4); import jax; "
        "print(jax.default_backend(), jax.device_count())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["cpu", "4"]
    assert "cuDNN" not in out.stderr  # the CUDA plugin did not try to start
