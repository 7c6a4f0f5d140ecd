"""README.md's code runs, so that its first example can never break again.

Every code block of README.md as GitHub renders it (CommonMark, parsed with markdown-it-py,
which rich depends on): ``` fences and 4-space indented blocks. One test per block:

- A ```python fence runs in a fresh interpreter with 8 simulated CPU devices (as the
  notebooks have), in a scratch copy of the repository (symlinks; what it writes stays
  there). PY_PLACEHOLDERS below are replaced first and PY_PRELUDE runs before it: the
  README names a checkpoint directory we do not ship and uses `tokens` without making it.
- Any other block is shell: one command per line (a trailing `\\` joins lines, `#` starts a
  comment, leading VAR=value words are the environment), after SHELL_PLACEHOLDERS are
  replaced. Each command is checked without running it:
  - `jaxtrain ...`, `.venv/bin/jaxtrain ...`, `python -m jaxtrain ...`: the CLI's own parser
    accepts the arguments; `train`, `compile` and `generate` configs (a YAML source) load
    with their overrides and validate; `compile` also resolves its target and mesh;
  - `python benchmarks/NAME.py --opt ...`: the script's `--help` runs and lists every option;
  - `make TARGET`: the Makefile has the target (`make -n`, which runs nothing here).
- `<!-- readme-test: run -->` on the line before a block: its `jaxtrain` commands then also
  run for real, in order, in one scratch copy (a later command may use an earlier one's
  output), `train` with `train.steps=2 logging.progress=false` appended.
- `<!-- readme-test: skip (REASON) -->` on the line before a block: not checked at all. For
  blocks that need a pod, a cluster or the network; the reason is required.
A command of any other kind fails, saying to mark its block or to teach this test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
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
MARKER = re.compile(r"<!--\s*readme-test:\s*(run|skip)\s*(?:\((.+?)\))?\s*-->")
RUN_OVERRIDES = ("train.steps=2", "logging.progress=false")


@dataclass
class Block:
    line: int  # 1-based line of the block's first line in README.md
    language: str  # "python" or "shell"
    code: str
    marker: str | None  # "run", "skip" or None
    reason: str | None


def readme_blocks() -> list[Block]:
    tokens = MarkdownIt("commonmark").parse(README.read_text())
    blocks = []
    for i, tok in enumerate(tokens):
        if tok.type not in ("fence", "code_block"):
            continue
        prev = tokens[i - 1] if i else None
        m = MARKER.search(prev.content) if prev is not None and prev.type == "html_block" else None
        language = "python" if tok.type == "fence" and tok.info.strip() == "python" else "shell"
        blocks.append(Block(tok.map[0] + 1, language, tok.content, m and m.group(1), m and m.group(2)))
    return blocks


BLOCKS = readme_blocks()


def scratch_repo(tmp_path: Path) -> Path:
    """A directory that looks like the repository (symlinks) but keeps what is written in it."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {"runs", "out", ".git", ".pytest_cache"}:
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
    from jaxtrain.compile import config_for_target, parse_target
    from jaxtrain.config import load_config

    try:
        args = cli._parser().parse_args(argv)
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


def check_script(words: list[str], env: dict[str, str]) -> None:
    """`python benchmarks/X.py --opt ...`: --help runs and lists every option used."""
    script = REPO / words[1]
    assert script.is_file(), f"{words[1]}: no such script"
    proc = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert proc.returncode == 0, f"{words[1]} --help failed:\n{proc.stderr[-2000:]}"
    for opt in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
        assert re.search(rf"(^|\s|\[){re.escape(opt)}\b", proc.stdout), f"{words[1]} has no option {opt}"


def run_jaxtrain(argv: list[str], env: dict[str, str], cwd: Path) -> None:
    if argv[0] == "train":
        argv = [*argv, *RUN_OVERRIDES]
    child_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sets its own
    proc = subprocess.run(
        [sys.executable, "-m", "jaxtrain", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**child_env, **env, "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"`jaxtrain {shlex.join(argv)}` exited {proc.returncode}:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


def test_readme_has_the_examples_we_promise():
    """The parser sees the README's blocks: the HF example is Python, and the markers parse."""
    assert any(b.language == "python" and "models.from_hf(" in b.code for b in BLOCKS)
    assert any(b.language == "python" and "models.generate(" in b.code for b in BLOCKS)
    for b in BLOCKS:
        assert b.marker != "skip" or b.reason, f"README.md:{b.line}: readme-test: skip needs a (reason)"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b.line}" for b in BLOCKS])
def test_readme_block(block: Block, tmp_path):
    if block.marker == "skip":
        pytest.skip(f"README.md:{block.line}: {block.reason}")
    cwd = scratch_repo(tmp_path)
    if block.language == "python":
        code = block.code
        for placeholder, value in PY_PLACEHOLDERS.items():
            code = code.replace(placeholder, value)
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
        proc = subprocess.run(
            [sys.executable, "-c", PY_PRELUDE + code],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, f"README.md:{block.line} (python) failed:\n{proc.stderr[-3000:]}"
        return
    commands = shell_commands(block.code)
    assert commands, f"README.md:{block.line}: an empty shell block"
    for words in commands:
        env, words = split_env(words)
        where = f"README.md:{block.line}: `{shlex.join(words)}`"
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
                "`<!-- readme-test: skip (why) -->` on the line before the block, "
                "or teach tests/test_readme.py"
            )
