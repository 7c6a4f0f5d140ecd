"""The composition table (jaxtrain/compose.py) against the code and the tests: each tested pair
names a collected test whose `composes` marker names the pair; every `composes` marker names
pairs the table calls tested; each refused pair is refused by `validate` with its one line, on
the config that switches on just those two features; every other pair is accepted there; each
feature's predicate sees its own config; docs/composition.md is the generated page. No compiles:
collection runs in a subprocess that imports the marked test files only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain import compose, compose_page
from jaxtrain.config import ConfigError, validate
from tests.conftest import REPO, child_env

# the features on in configs/tiny.yaml as it is (the defaults of their keys)
BASE = {"lm", "dense", "adamw"}

_COLLECT = """
import json, sys
import pytest

class Marks:
    def __init__(self):
        self.items = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            pairs = [p for m in item.iter_markers("composes") for p in m.args]
            self.items[item.nodeid] = pairs

marks = Marks()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[2:]], plugins=[marks])
with open(sys.argv[1], "w") as f:
    json.dump({"code": int(code), "items": marks.items}, f)
"""


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, list[str]]:
    """node id -> the pairs its `composes` markers name, over the files the table names and
    the files that use the marker."""
    files = {t.test.split("::")[0] for t in compose.PAIRS.values() if isinstance(t, compose.Tested)}
    for path in sorted(Path(REPO, "tests").glob("test_*.py")):
        if path.name != "test_compose.py" and "mark.composes" in path.read_text():
            files.add(f"tests/{path.name}")
    out = tmp_path_factory.mktemp("collect") / "items.json"
    run = subprocess.run(
        [sys.executable, "-c", _COLLECT, str(out), *sorted(files)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["code"] == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return result["items"]


def test_each_tested_pair_names_a_test_that_is_marked_with_it(collected):
    wrong = []
    for (a, b), status in compose.PAIRS.items():
        if not isinstance(status, compose.Tested):
            continue
        if status.test not in collected:
            wrong.append(f"{a}+{b}: {status.test} is not a collected test")
        elif not {f"{a}+{b}", f"{b}+{a}"} & set(collected[status.test]):
            wrong.append(f"{a}+{b}: {status.test} has no @pytest.mark.composes({a}+{b}!r)")
    assert not wrong, "\n".join(wrong)


def test_every_composes_marker_names_tested_pairs_of_known_features(collected):
    wrong = []
    for node, pairs in collected.items():
        for text in pairs:
            names = text.split("+")
            if len(names) != 2 or any(n not in compose.BY_NAME for n in names):
                wrong.append(f"{node}: {text!r} is not a pair of known features ({', '.join(compose.NAMES)})")
            elif not isinstance(compose.status(*names), compose.Tested):
                wrong.append(
                    f"{node}: {text} is {type(compose.status(*names)).__name__} in jaxtrain/compose.py"
                )
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> str:
    """A token directory as `jaxtrain tokenize --chat` marks it (the predicate reads the manifest)."""
    d = tmp_path_factory.mktemp("chat_tokens")
    (d / "manifest.json").write_text(json.dumps({"chat": {"mask": True}}))
    return str(d)


def minimal_config(chat_dir: str, *names: str):
    """configs/tiny.yaml with the features' minimal overrides, not validated."""
    overrides = [o.replace(compose.CHAT_DIR, chat_dir) for o in compose.minimal_overrides(*names)]
    return compose_page.example_config(overrides)


@pytest.mark.parametrize("name", compose.NAMES)
def test_each_feature_is_seen_on_its_own_config(chat_dir, name):
    feature = compose.BY_NAME[name]
    implied = {"sequence_parallel": {"tensor"}}.get(name, set())
    defaults = {n for n in BASE if compose.BY_NAME[n].group != feature.group}
    cfg = minimal_config(chat_dir, name)
    assert set(compose.active(cfg)) == {name, *defaults, *implied}
    validate(cfg)  # each feature alone is accepted


def test_each_pair_is_refused_with_its_line_or_accepted(chat_dir):
    """Refused pairs: ConfigError with exactly the table's line (one line); the rest: accepted."""
    wrong = []
    for a, b in compose.all_pairs():
        cfg = minimal_config(chat_dir, a, b)
        assert {a, b} <= set(compose.active(cfg)), (a, b)
        status = compose.status(a, b)
        try:
            validate(cfg)
            error = None
        except ConfigError as e:
            error = str(e)
        if isinstance(status, compose.Refused):
            want = status.message(cfg)
            if error != want or "\n" in want:
                wrong.append(f"{a}+{b}: expected {want!r}, got {error!r}")
        elif error is not None:
            wrong.append(f"{a}+{b} ({type(status).__name__}): refused outside the table: {error}")
    assert not wrong, "\n".join(wrong)


def test_every_pair_is_tested_or_refused():
    """Issue #62's goal, held: no pair a config can switch on is accepted without a test that
    runs the two together (a new feature brings its tests, or its refusals, with it)."""
    untested = [
        f"{a}+{b}" for a, b in compose.all_pairs() if isinstance(compose.status(a, b), compose.Untested)
    ]
    assert not untested, untested


def test_untested_pairs_are_named_in_one_warning_line(chat_dir, caplog, monkeypatch):
    """(A feature added without its tests: the pair is taken out of the table here.)"""
    a, b = "sinks", "qk_norm"
    monkeypatch.delitem(compose.PAIRS, compose.pair(a, b))
    assert isinstance(compose.status(a, b), compose.Untested)
    compose._warned.clear()
    with caplog.at_level("WARNING", logger="jaxtrain.compose"):
        validate(minimal_config(chat_dir, a, b))
    (record,) = [r for r in caplog.records if r.name == "jaxtrain.compose"]
    assert f"{a}+{b}" in record.getMessage() and "\n" not in record.getMessage()


def test_the_docs_page_is_the_generated_one():
    """docs/composition.md is `python -m jaxtrain.compose_page`'s output (rerun it after a change)."""
    page = Path(REPO, "docs", "composition.md").read_text()
    assert page == compose_page.page()


def test_the_cli_refuses_a_refused_pair_in_one_line(tmp_path):
    """`jaxtrain train` exits 2 with the table's line before anything compiles."""
    run = subprocess.run(
        [sys.executable, "-m", "jaxtrain", "train", f"{REPO}/configs/tiny.yaml", f"output_dir={tmp_path}",
         "model.mtp={depth: 1}", "mesh.context=2"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "model.mtp with mesh.context=2: the prediction modules read tokens ahead" in run.stderr
    assert not os.path.exists(tmp_path / "checkpoints")
