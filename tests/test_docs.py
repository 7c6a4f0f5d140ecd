"""The docs' code runs, so that no example in README.md or docs/ can silently break; and the
docs site builds.

Every code block of README.md and of every page under docs/, as they render (CommonMark,
parsed with markdown-it-py, which rich depends on). One test per block, named FILE:LINE:

- A ```python fence runs in a fresh interpreter with 8 simulated CPU devices (as the
  notebooks have), in a scratch copy of the repository (symlinks; what it writes stays
  there). PY_PLACEHOLDERS below are replaced first and PY_PRELUDE runs before it: the docs
  name a checkpoint directory we do not ship and use `tokens` without making it. Each one
  costs an interpreter start, so the docs keep their Python blocks few and small.
- A ```bash, ```shell or ```sh fence, an unlabelled one, or an indented block is shell: one
  command per line (a trailing `\\` joins lines, `#` starts a comment, leading VAR=value
  words are the environment), after SHELL_PLACEHOLDERS are replaced. Each command is checked
  without running it:
  - `jaxtrain ...`, `.venv/bin/jaxtrain ...`, `python -m jaxtrain ...`: the CLI's own parser
    accepts the arguments; `train`, `compile` and `generate` configs (a YAML source) load
    with their overrides and validate; `compile` also resolves its target and mesh;
  - `python benchmarks/NAME.py --opt ...`: the script's `--help` runs and lists every option;
  - `make TARGET`: the Makefile has the target (`make -n`, which runs nothing here).
- Fences in any other language (NOT_CODE: ```text for formulas and output, ```yaml,
  ```mermaid diagrams, ...) are not code and not collected. A language in neither list fails
  `test_every_fence_has_a_known_language`, so a typo cannot silently skip a block.
- `<!-- docs-test: run -->` on the line before a block: its `jaxtrain` commands then also
  run for real, in order, in one scratch copy (a later command may use an earlier one's
  output), `train` with `train.steps=2 logging.progress=false` appended. Each is a training
  run: keep them to a handful.
- `<!-- docs-test: skip (REASON) -->` on the line before a block: not checked at all. For
  blocks that need a pod, a cluster or the network; the reason is required.
A shell command of any other kind fails, saying to mark its block or to teach this test.

`test_site_builds` runs `mkdocs build --strict` (broken links or anchors, a page missing
from the nav, a configuration reference the hook cannot generate: all fail it).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests.conftest import child_env

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 250
HF_ASSET = "tests/assets/hf/llama_tied"

PY_PLACEHOLDERS = {'"path/to/Llama-3.1-8B"': f'"{HF_ASSET}"'}
PY_PRELUDE = "import numpy as np\ntokens = np.array([[1, 5, 9, 2, 7, 3, 4], [1, 8, 6, 0, 0, 0, 0]])\n"
# Whole words of a shell command -> the words the test uses (none: the word is dropped).
SHELL_PLACEHOLDERS = {
    "CONFIG.yaml": "configs/tiny.yaml",
    "CONFIG": "configs/tiny.yaml mesh.data=2",  # the multi-process example: 2 processes need 2 devices
    "key.sub=value": "train.steps=2",
    "...": "",
    "HF_DIR": HF_ASSET,
    "CKPT_DIR": "ckpt",
    "OUTPUT_DIR": "runs/tiny",
    "process_id=$I": "process_id=0",
    "distributed.process_id=$I": "distributed.process_id=0",
}
MARKER = re.compile(r"<!--\s*docs-test:\s*(run|skip)\s*(?:\((.+?)\))?\s*-->")
OLD_MARKER = re.compile(r"<!--\s*readme-test:")
RUN_OVERRIDES = ("train.steps=2", "logging.progress=false")
# Fence languages that are code, and what kind.
CODE = {"python": "python", "bash": "shell", "shell": "shell", "sh": "shell", "": "shell"}
# Fence languages that are not code: formulas, output, configs, diagrams.
NOT_CODE = {"text", "yaml", "json", "toml", "mermaid"}


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


@dataclass
class Block:
    file: str  # path relative to the repository
    line: int  # 1-based line of the block's first line in the file
    language: str  # "python" or "shell"
    code: str
    marker: str | None  # "run", "skip" or None
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _fence_language(tok) -> str:
    return tok.info.strip().split()[0] if tok.info.strip() else ""


def _tokens(path: Path):
    return MarkdownIt("commonmark").parse(path.read_text())


def code_blocks(path: Path) -> list[Block]:
    rel = str(path.relative_to(REPO))
    tokens = _tokens(path)
    blocks = []
    for i, tok in enumerate(tokens):
        if tok.type not in ("fence", "code_block"):
            continue
        language = CODE.get(_fence_language(tok)) if tok.type == "fence" else "shell"
        if language is None:
            continue  # NOT_CODE (or unknown: test_every_fence_has_a_known_language says so)
        prev = tokens[i - 1] if i else None
        m = MARKER.search(prev.content) if prev is not None and prev.type == "html_block" else None
        blocks.append(Block(rel, tok.map[0] + 1, language, tok.content, m and m.group(1), m and m.group(2)))
    return blocks


BLOCKS = [b for path in doc_files() for b in code_blocks(path)]


def scratch_repo(tmp_path: Path) -> Path:
    """A directory that looks like the repository (symlinks) but keeps what is written in it."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {"runs", "out", "site", ".git", ".pytest_cache"}:
            (root / entry.name).symlink_to(entry)
    return root


def shell_commands(code: str) -> list[list[str]]:
    """Commands of a shell block as argv lists (comments, continuations and placeholders handled)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        words = [
            x for w in words for x in (SHELL_PLACEHOLDERS[w].split() if w in SHELL_PLACEHOLDERS else [w])
        ]
        if words:
            commands.append(words)
    return commands


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    return env, words


def jaxtrain_argv(words: list[str]) -> list[str] | None:
    """The arguments after `jaxtrain` if this is a jaxtrain command, else None."""
    if words[0] in ("jaxtrain", ".venv/bin/jaxtrain"):
        return words[1:]
    if Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "jaxtrain"]:
        return words[3:]
    return None


def check_jaxtrain(argv: list[str]) -> None:
    """The CLI parses `argv`; configs load and validate; compile targets and meshes resolve."""
    from jaxtrain import cli
    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import config_for_target, parse_target

    try:
        args = cli.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`jaxtrain {shlex.join(argv)}`: the CLI rejects these arguments (exit {e.code})")
    config = getattr(args, "config", None) or getattr(args, "source", None)
    if args.command not in ("train", "compile", "generate") or not str(config).endswith((".yaml", ".yml")):
        return
    cfg = load_config(REPO / config, args.overrides)
    if args.command == "compile":
        target = parse_target(
            args.target, slices=args.slices, hosts=args.hosts, gpus_per_host=args.gpus_per_host
        )
        if getattr(args, "mode", "train") == "train":
            config_for_target(cfg, target)


@functools.cache
def script_help(script: str, env: tuple[tuple[str, str], ...]) -> str:
    """`python SCRIPT --help`, once per script and environment (several blocks name the same one)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / script), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **dict(env), "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-2000:]}"
    return proc.stdout


def check_script(words: list[str], env: dict[str, str]) -> None:
    """`python benchmarks/X.py --opt ...`: --help runs and lists every option used."""
    assert (REPO / words[1]).is_file(), f"{words[1]}: no such script"
    usage = script_help(words[1], tuple(sorted(env.items())))
    for opt in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
        assert re.search(rf"(^|\s|\[){re.escape(opt)}\b", usage), f"{words[1]} has no option {opt}"


def run_jaxtrain(argv: list[str], env: dict[str, str], cwd: Path) -> None:
    if argv[0] == "train":
        argv = [*argv, *RUN_OVERRIDES]
    env_of_child = child_env()  # the CLI sets its own device count
    proc = subprocess.run(
        [sys.executable, "-m", "jaxtrain", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**env_of_child, **env, "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"`jaxtrain {shlex.join(argv)}` exited {proc.returncode}:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


# --- the pages as a whole -------------------------------------------------------------------


def test_docs_have_the_examples_we_promise():
    """The parser sees the blocks: the HF example is Python, and skip markers give a reason."""
    assert any(b.language == "python" and "models.from_hf(" in b.code for b in BLOCKS)
    assert any(b.language == "python" and "models.generate(" in b.code for b in BLOCKS)
    assert any(b.file == "README.md" and b.marker == "run" for b in BLOCKS), "the README's quickstart runs"
    for b in BLOCKS:
        assert b.marker != "skip" or b.reason, f"{b.where}: docs-test: skip needs a (reason)"
        assert b.marker != "run" or b.language == "shell", f"{b.where}: docs-test: run is for shell blocks"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_fence_has_a_known_language(path):
    for tok in _tokens(path):
        if tok.type == "fence":
            language = _fence_language(tok)
            assert language in CODE or language in NOT_CODE, (
                f"{path.relative_to(REPO)}:{tok.map[0] + 1}: fence language {language!r} is neither code "
                f"{sorted(CODE)} nor known non-code {sorted(NOT_CODE)}"
            )


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_markers_sit_on_code_blocks(path):
    """A docs-test marker applies to the code block right after it; anywhere else it does nothing."""
    rel = path.relative_to(REPO)
    tokens = _tokens(path)
    for i, tok in enumerate(tokens):
        if tok.type != "html_block":
            continue
        assert not OLD_MARKER.search(tok.content), f"{rel}:{tok.map[0] + 1}: the marker is now `docs-test`"
        if MARKER.search(tok.content):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            ok = nxt is not None and (
                nxt.type == "code_block" or (nxt.type == "fence" and _fence_language(nxt) in CODE)
            )
            assert ok, f"{rel}:{tok.map[0] + 1}: a docs-test marker must sit on the line before a code block"


def test_readme_is_one_page():
    text = README.read_text()
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_cite_only_this_repository(path):
    """Paths outside the repository mean nothing to a reader of the published docs."""
    assert "../shared" not in path.read_text(), f"{path.relative_to(REPO)} cites ../shared"


def test_site_builds(tmp_path):
    """`mkdocs build --strict`; the configuration reference is generated by the hook."""
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    reference = (site / "configuration" / "index.html").read_text()
    assert "config-reference" not in reference, "the hook left its marker in the page"
    for key in ("model.vocab_size", "model.moe.top_k", "optimizer.loss_scale.init", "eval.paths"):
        assert key in reference, f"the configuration reference has no row for {key}"


# --- one test per code block ------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_docs_block(block: Block, tmp_path):
    if block.marker == "skip":
        pytest.skip(f"{block.where}: {block.reason}")
    cwd = scratch_repo(tmp_path)
    if block.language == "python":
        code = block.code
        for placeholder, value in PY_PLACEHOLDERS.items():
            code = code.replace(placeholder, value)
        env = {**child_env(devices=8), "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run(
            [sys.executable, "-c", PY_PRELUDE + code],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, f"{block.where} (python) failed:\n{proc.stderr[-3000:]}"
        return
    commands = shell_commands(block.code)
    assert commands, f"{block.where}: an empty shell block"
    for words in commands:
        env, words = split_env(words)
        where = f"{block.where}: `{shlex.join(words)}`"
        argv = jaxtrain_argv(words)
        if argv is not None:
            check_jaxtrain(argv)
            if block.marker == "run":
                run_jaxtrain(argv, env, cwd)
        elif words[0] == "make":
            proc = subprocess.run(["make", "-n", *words[1:]], capture_output=True, text=True, cwd=REPO)
            assert proc.returncode == 0, f"{where}: {proc.stderr.strip()}"
        elif Path(words[0]).name.startswith("python") and words[1:2] and words[1].endswith(".py"):
            check_script(words, env)
        else:
            pytest.fail(
                f"{where}: this test does not know how to check `{words[0]}`; put "
                "`<!-- docs-test: skip (why) -->` on the line before the block, "
                "or teach tests/test_docs.py"
            )
