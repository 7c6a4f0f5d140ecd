"""jaxtrain.evaluation.JaxtrainLM and `jaxtrain eval` against lm-eval's own `hf` backend (HFLM).

The oracle: tests/assets/lm_eval/expected.json, what lm-eval 0.4.13's HFLM (transformers 5.25,
torch, float32) answers on a tiny random Llama with a BPE tokenizer (tests/assets/lm_eval/
tiny_llama, a 64-position context) for three local tasks, one per output type: multiple choice
with contexts cut on the left, rolling perplexity over documents of several windows, greedy
generate_until with stop strings (and the same with the chat template). Written by
tests/assets/make_lm_eval_assets.py; no torch here.

Tolerances: per-token log-probs agree to about 1e-6 (f32, different matmul orders); a request's
sum to 1e-5 relative (1e-5 absolute below 1: rolling sums reach -1900). is_greedy, the
generated strings and every metric must be the same (metrics to 1e-6 relative, computed from
those numbers).

Nothing downloads: the tasks read local JSON files (`dataset_path: json`), HF_DATASETS_OFFLINE=1.
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm_eval imports datasets

import jax  # noqa: E402
import pytest  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from jaxtrain import cli  # noqa: E402
from jaxtrain.evaluation import JaxtrainLM, bucket  # noqa: E402
from tests.conftest import REPO, child_env  # noqa: E402

ASSETS = Path(REPO) / "tests" / "assets" / "lm_eval"
MODEL = ASSETS / "tiny_llama"
EXPECTED = json.loads((ASSETS / "expected.json").read_text())
TASKS = ("tiny_mc", "tiny_rolling", "tiny_gen")
SEEDS = dict(random_seed=0, numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)
MESH = ("mesh.data=2", "mesh.tensor=2")


def write_tasks(dest: Path) -> Path:
    """The committed task YAMLs with their data folder filled in (as the asset script does)."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in glob.glob(str(ASSETS / "tasks" / "*")):
        text = Path(path).read_text()
        if path.endswith(".yaml"):
            text = text.replace("__TASKS__", str(ASSETS / "tasks"))
        (dest / Path(path).name).write_text(text)
    return dest


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def manager(tasks):
    """lm-eval's index of its 14,000 tasks and ours: about 10 s to build, so built once."""
    return TaskManager(include_path=str(tasks))


@pytest.fixture(scope="module")
def lm():
    """One device, 4 requests per batch (the oracle ran 1 per batch)."""
    return JaxtrainLM(MODEL, batch_size=4, devices=jax.devices()[:1])


def evaluate(lm, manager, names, **kw):
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=list(names),
        task_manager=manager,
        log_samples=True,
        **SEEDS,
        **kw,
    )


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def assert_answers(samples: dict, expected: dict) -> None:
    """Per task: each request's answer as HFLM's (module docstring's tolerances), and the metrics."""
    for task, want in expected.items():
        got = sorted(samples[task], key=lambda s: s["doc_id"])
        assert len(got) == len(want["samples"]), task
        for s, e in zip(got, want["samples"]):
            assert [list(a) for a in s["arguments"]] == e["arguments"], (task, s["doc_id"])
            for mine, theirs in zip(s["resps"], e["resps"], strict=True):
                mine = mine[0]
                theirs = theirs[0]
                if isinstance(theirs, str):
                    assert mine == theirs, (task, s["doc_id"])
                elif isinstance(theirs, list):  # (loglikelihood, is_greedy)
                    assert close(mine[0], theirs[0]) and bool(mine[1]) == theirs[1], (
                        task,
                        s["doc_id"],
                        mine,
                        theirs,
                    )
                else:  # a rolling sum
                    assert close(mine, theirs), (task, s["doc_id"], mine, theirs)
            for metric, value in e["metrics"].items():  # a number, or (loglikelihood, words) for perplexities
                mine, theirs = json.loads(json.dumps(s[metric], default=float)), value
                if isinstance(theirs, list):
                    assert mine[1] == theirs[1] and close(mine[0], theirs[0]), (task, metric)
                else:
                    assert abs(mine - theirs) <= 1e-6 * max(1.0, abs(theirs)), (task, metric)


def assert_metrics(results: dict, expected: dict) -> None:
    for task, want in expected.items():
        for key, value in want["results"].items():
            if isinstance(value, float):
                assert abs(results[task][key] - value) <= 1e-6 * abs(value), (task, key)
            else:
                assert results[task][key] == value, (task, key)


def test_every_request_type_answers_as_the_hf_backend(lm, manager):
    out = evaluate(lm, manager, TASKS)
    expected = EXPECTED["plain"]
    assert_answers(out["samples"], expected)
    assert_metrics(out["results"], expected)
    # the assets exercise what they claim: left truncation, several rolling windows, stop strings
    greedy = [r[0][1] for s in expected["tiny_mc"]["samples"] for r in s["resps"]]
    assert any(greedy) and not all(greedy)
    assert any(s["resps"][0][0] == "" for s in expected["tiny_gen"]["samples"])


def test_a_sharded_mesh_and_other_batch_sizes_answer_the_same(manager):
    """data=2 x tensor=2 (4 of the 8 simulated devices), 3 requests per batch (padded to 4 rows)."""
    lm = JaxtrainLM(MODEL, MESH, batch_size=3)
    assert dict(lm._mesh.shape) == {"data": 2, "tensor": 2} | {
        a: 1 for a in lm._mesh.shape if a not in ("data", "tensor")
    }
    out = evaluate(lm, manager, TASKS)
    assert_answers(out["samples"], EXPECTED["plain"])
    assert_metrics(out["results"], EXPECTED["plain"])


def test_chat_template_prompts_as_the_hf_backend(lm, manager):
    out = evaluate(lm, manager, ["tiny_gen"], apply_chat_template=True)
    assert_answers(out["samples"], EXPECTED["chat"])
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there "}]
    assert lm.apply_chat_template(chat[:1]) == "<s>user: hi\nassistant:"
    # transformers 5.25 (continue_final_message=True, as HFLM asks) gives exactly these
    assert lm.apply_chat_template(chat, add_generation_prompt=False) == "<s>user: hi\nassistant: hello there "
    assert lm.tok_encode("<s>user: hi")[:2] == [1, 87]  # BOS written by the template is not doubled


def test_sampling_is_seeded_and_differs_from_greedy(lm):
    """do_sample: the same seed gives the same text (sampling is not compared with torch's)."""
    kwargs = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0}
    requests = [
        Instance("generate_until", {}, ("the model", kwargs), 0),
        Instance("generate_until", {}, ("a longer prompt about sharding rules", dict(kwargs)), 1),
    ]
    greedy = [
        Instance("generate_until", {}, (r.args[0], {"until": ["\n\n"], "max_gen_toks": 8}), i)
        for i, r in enumerate(requests)
    ]
    first, again = lm.generate_until(requests), lm.generate_until(requests)
    assert first == again and first != lm.generate_until(greedy)


def test_left_truncation_and_padding_buckets(lm):
    """A context longer than the model keeps its last tokens, as HFLM: the answer equals the
    one for the context cut by hand; the padded length is a power of two, at most the context."""
    ctx = lm.tok_encode("the mesh " * 40)
    cont = lm.tok_encode(" data", add_special_tokens=False)
    whole = lm._loglikelihood_tokens([(None, ctx, cont)])[0]
    cut = lm._loglikelihood_tokens([(None, ctx[-(64 + 1 - len(cont)) :], cont)])[0]
    assert close(whole[0], cut[0]) and whole[1] == cut[1]
    assert [bucket(n, 64) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


def test_cli_writes_lm_evals_files_and_table(tasks, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(
        ["eval", str(MODEL), "--tasks", "tiny_mc,tiny_gen", "--include-path", str(tasks)]
        + ["--batch-size", "4", "--output-path", str(out), "--log-samples"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "tiny_mc" in captured.out and "acc" in captured.out and "exact_match" in captured.out
    (folder,) = out.iterdir()  # lm-eval's sanitized model name
    assert folder.name == lm_eval.utils.sanitize_model_name(str(MODEL))
    (results,) = folder.glob("results_*.json")
    results = json.loads(results.read_text())
    expected = {k: EXPECTED["plain"][k] for k in ("tiny_mc", "tiny_gen")}
    assert_metrics(results["results"], expected)
    for task in expected:
        (path,) = folder.glob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == len(expected[task]["samples"])


def test_cli_subprocess_on_a_mesh_with_a_limit(tasks, tmp_path):
    """As a user runs it: a fresh process simulates the 4 devices; --limit 3 (a count), auto batches."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxtrain", "eval", str(MODEL), *MESH, "--tasks", "tiny_rolling"]
        + [
            "--include-path",
            str(tasks),
            "--limit",
            "3",
            "--batch-size",
            "auto",
            "--output-path",
            str(tmp_path),
        ]
        + ["--log-samples"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh {'data': 2, 'tensor': 2}" in out.stderr
    (path,) = tmp_path.glob("*/samples_tiny_rolling_*.jsonl")
    rows = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["doc_id"])
    want = EXPECTED["plain"]["tiny_rolling"]["samples"][:3]
    assert [r["doc_id"] for r in rows] == [0, 1, 2]
    for row, e in zip(rows, want):
        assert close(float(row["resps"][0][0]), e["resps"][0][0])


@pytest.mark.parametrize(
    "args, message",
    [
        (["mesh.context=2"], "generation needs mesh.context=1"),
        (["mesh.stage=2"], "mesh.stage=2: generation has no pipeline schedule"),
        (["--tasks", "no_such_task"], "unknown task(s) no_such_task"),
        (["--limit", "-1"], "--limit=-1"),
        (["--log-samples"], "--log-samples: needs --output-path"),
        (["--batch-size", "many"], "batch_size='many'"),
        (["--max-len", "12", "--tasks", "tiny_gen"], "max_gen_toks=12 leaves no room"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tasks, capsys):
    argv = ["eval", str(MODEL), "--include-path", str(tasks), *args]
    if "--tasks" not in args:
        argv += ["--tasks", "tiny_mc"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("jaxtrain: error: ") and message in last, err
    assert "Traceback" not in err


# --- during training: eval.tasks ----------------------------------------------------------------


def test_in_loop_tasks_equal_the_cli_on_the_same_checkpoint(tasks, tmp_path):
    """configs/tiny.yaml (byte tokenizer, 128-position context) on data=2, tasks alone
    (eval.batches=0) at its last step: the metrics the loop logs are those `jaxtrain eval`
    gives on the checkpoint of that step (the same weights, the saved config's mesh)."""
    from jaxtrain.trainer import train
    from tests.conftest import tiny_config

    run_dir = tmp_path / "run"
    cfg = tiny_config(
        run_dir,
        "train.steps=2",
        "checkpoint.every=2",
        "mesh.data=2",
        "eval.every=2",
        "eval.batches=0",
        "eval.tasks=[tiny_mc,tiny_rolling]",
        f"eval.include_path={tasks}",
        "eval.limit=3",
        "eval.task_batch_size=4",
    )
    result = train(cfg, devices=jax.devices()[:2])
    (record,) = result.evals
    assert "eval_loss" not in record and record["eval_tasks_time_s"] > 0
    metrics = {k: v for k, v in record.items() if "/" in k}
    assert set(metrics) == {
        "eval_tiny_mc/acc",
        "eval_tiny_mc/acc_norm",
        "eval_tiny_rolling/word_perplexity",
        "eval_tiny_rolling/byte_perplexity",
        "eval_tiny_rolling/bits_per_byte",
    }
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(
        r.get("eval_tiny_rolling/bits_per_byte") == metrics["eval_tiny_rolling/bits_per_byte"] for r in logged
    )

    out = tmp_path / "cli"
    code = cli.main(
        ["eval", str(run_dir), "--tasks", "tiny_mc,tiny_rolling", "--include-path", str(tasks)]
        + ["--limit", "3", "--batch-size", "4", "--output-path", str(out)]
    )
    assert code == 0
    (path,) = out.glob("*/results_*.json")
    from jaxtrain.evaluation import task_metrics

    cli_metrics = task_metrics(json.loads(path.read_text()))
    assert set(cli_metrics) == set(metrics)
    for key, value in metrics.items():
        assert abs(cli_metrics[key] - value) <= 1e-6 * abs(value), key


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["eval.every=2", "eval.batches=0"], "eval.batches=0: expected a positive integer"),
        (["eval.every=2", "eval.tasks=[tiny_mc]", "eval.limit=1.5"], "eval.limit=1.5"),
        (["eval.every=2", "eval.tasks=[tiny_mc]", "eval.task_batch_size=0"], "eval.task_batch_size=0"),
        (["eval.every=2", "eval.tasks=[tiny_mc]", "mesh.context=2"], "eval.tasks with mesh.context=2"),
        (["eval.every=2", "eval.tasks=[tiny_mc]", "mesh.dcn_data=2"], "eval.tasks with several processes"),
        (
            ["eval.every=2", "eval.tasks=[tiny_mc]", "optimizer.offload_params=true"],
            "eval.tasks with optimizer.offload_params=true",
        ),
    ],
)
def test_bad_eval_task_keys_are_refused(overrides, message):
    from jaxtrain.config import ConfigError
    from tests.conftest import tiny_config

    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        tiny_config(None, *overrides)
