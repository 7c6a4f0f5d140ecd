"""Result files (benchmarks/result_file.py) and the docs' tables made from them
(benchmarks/report.py): the page agrees with the committed results, and `--check` catches each
way they can come apart. Pure Python: no jax program runs here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report, result_file

REPO = Path(__file__).resolve().parent.parent

PAGE = """# Figures

<!-- results: demo step -->
| run | s/step | source |
|---|---:|---|
| old | 2.0 | untraced |
<!-- /results -->

<!-- results: untraced -->
| what | figure | source |
|---|---|---|
| a compile | 1 GiB | untraced |
<!-- /results -->
"""


def write_result(results: Path, rows: list[list[str]], name: str = "20261129T000000Z-abc.json") -> Path:
    path = results / "demo" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    table = result_file.check_table("step", ["run", "s/step"], rows)
    path.write_text(json.dumps({"script": "demo", "tables": {"step": table}}))
    return path


def test_docs_benchmarks_page_agrees_with_the_results():
    """The suite's run of `python benchmarks/report.py --check` on the real page and results."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "report.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_tables_are_generated_from_result_files_and_keep_untraced_rows(tmp_path):
    results = tmp_path / "results"
    write_result(results, [["auto", "0.18"], ["none", "0.17"]])
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    assert report.main(["--page", str(page), "--results", str(results)]) == 0
    text = page.read_text()
    # hand-written oracle: the file's rows with their source, then the untraced row as it was
    src = "`demo/20261129T000000Z-abc.json`"
    assert f"| auto | 0.18 | {src} |\n| none | 0.17 | {src} |\n| old | 2.0 | untraced |\n" in text
    assert "| a compile | 1 GiB | untraced |" in text
    assert report.check(page, results) == []


def test_check_names_the_table_and_the_row_a_hand_edit_changed(tmp_path):
    results = tmp_path / "results"
    write_result(results, [["auto", "0.18"]])
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    report.main(["--page", str(page), "--results", str(results)])
    page.write_text(page.read_text().replace("| auto | 0.18 |", "| auto | 0.17 |"))
    problems = report.check(page, results)
    assert len(problems) == 1
    assert "table `demo step`" in problems[0] and "| auto | 0.17 |" in problems[0]
    assert "| auto | 0.18 |" in problems[0]
    assert report.main(["--check", "--page", str(page), "--results", str(results)]) == 1


def test_check_fails_on_a_new_result_a_stray_table_and_an_unquoted_file(tmp_path):
    results = tmp_path / "results"
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    assert report.check(page, results) == []
    write_result(results, [["auto", "0.18"]])  # a result the page does not show yet
    assert any("table `demo step`" in p for p in report.check(page, results))
    (results / "other").mkdir()
    (results / "other" / "x.json").write_text(json.dumps({"tables": {"t": {"header": [], "rows": []}}}))
    assert any("other/x.json is quoted by no table" in p for p in report.check(page, results))
    page.write_text(PAGE + "\n| a | stray | row |\n")
    assert any("outside a `<!-- results" in p for p in report.check(page, results))


def test_untraced_rows_need_the_headers_cells_and_a_source_column(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE.replace("| old | 2.0 | untraced |", "| old | untraced |"))
    assert any("untraced row 1 has 2 cells" in p for p in report.check(page, tmp_path))
    page.write_text(PAGE.replace("| run | s/step | source |", "| run | s/step | where |"))
    assert any("last column must be `source`" in p for p in report.check(page, tmp_path))


def test_a_recorded_run_writes_its_provenance_tables_and_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXTRAIN_RESULTS_DIR", str(tmp_path))
    argv = ["benchmarks/demo.py", "--steps", "3"]
    with result_file.record("demo", argv) as rec:
        print("step 0.5 s")
        print('auto: {"step_time_s": 0.5} (3 s)', file=sys.stderr)
        print("| run | s |\n|---|---:|\n| auto | 0.5 |")
        rec.figures["step_time_s"] = 0.5
        rec.table("step", ["run", "s/step"], [["auto", 0.5]])
    body = json.loads(rec.path.read_text())
    assert rec.path.parent == tmp_path / "demo"
    # oracle: git itself, and this interpreter
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert body["git"]["sha"] == head and body["git"]["clean"] in (True, False)
    assert rec.path.name.endswith(f"-{head[:8]}.json")
    assert body["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert {"jax", "flax", "optax"} <= set(body["versions"])
    assert body["command"]["line"] == "python benchmarks/demo.py --steps 3"
    assert body["machine"]["cpu_count"] >= 1 and body["machine"]["cpu"]
    assert body["figures"] == {"step_time_s": 0.5, "json_rows": [{"step_time_s": 0.5}]}
    assert body["tables"]["step"] == {"header": ["run", "s/step"], "rows": [["auto", "0.5"]]}
    assert body["tables"]["printed_1"] == {"header": ["run", "s"], "rows": [["auto", "0.5"]]}
    assert body["printed"] == "step 0.5 s\n| run | s |\n|---|---:|\n| auto | 0.5 |\n"
    assert "step 0.5 s" in capsys.readouterr().out  # still printed


def test_a_failed_run_writes_nothing_and_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_RESULTS_DIR", str(tmp_path))
    with pytest.raises(RuntimeError), result_file.record("demo") as rec:
        raise RuntimeError("boom")
    assert rec.path is None and not (tmp_path / "demo").exists()
    monkeypatch.setenv("JAXTRAIN_RESULTS_DIR", "off")
    with result_file.record("demo") as rec:
        rec.figures["x"] = 1
    assert rec.path is None and not (tmp_path / "demo").exists()


def test_a_tree_without_git_reads_the_revision_file(tmp_path):
    (tmp_path / "REVISION").write_text("0123abcd dirty\n")
    state = result_file.git_state(tmp_path / "no-repo", tmp_path / "REVISION")
    assert state == {"sha": "0123abcd", "clean": False}
    assert result_file.git_state(tmp_path / "no-repo", tmp_path / "none") == {"sha": None, "clean": None}


def test_tables_must_have_the_headers_cells_and_repeats_give_min_median_max():
    with pytest.raises(ValueError, match="table 'step' row 1: 1 cells, expected 2"):
        result_file.check_table("step", ["a", "b"], [["1", "2"], ["3"]])
    assert result_file.repeat_stats([0.3, 0.1, 0.2]) == {"min": 0.1, "median": 0.2, "max": 0.3, "n": 3}
    with pytest.raises(ValueError):
        result_file.repeat_stats([])


def test_run_records_main_unless_it_fails_or_is_a_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_RESULTS_DIR", str(tmp_path))

    def main():
        result_file.add_figures(rows=[1, 2])
        result_file.add_table("t", ["a"], [["1"]])
        return 0

    assert result_file.run("demo", main, ["benchmarks/demo.py"]) == 0
    (written,) = (tmp_path / "demo").glob("*.json")
    body = json.loads(written.read_text())
    assert body["figures"] == {"rows": [1, 2]} and body["tables"]["t"]["rows"] == [["1"]]
    assert result_file.run("failing", lambda: 2, ["benchmarks/failing.py"]) == 2
    assert result_file.run("worker", main, ["benchmarks/worker.py", "--worker", "matmul"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
    result_file.add_figures(ignored=True)  # no run records: nothing happens
    assert result_file.current() is None


def test_every_benchmark_script_records_its_run():
    """Every script of benchmarks/ with a __main__ writes a result file: through
    `result_file.run` around its main, or `result_file.record` inside it (gpu_peer.py, whose
    workers run the same file). report.py, the helpers and the peers' shell scripts print no
    figures."""
    helpers = {"report.py", "result_file.py", "torch_peer.py"}
    unrecorded = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        text = path.read_text()
        if path.name in helpers or '__name__ == "__main__"' not in text:
            continue
        if "result_file.run(" not in text and "result_file.record(" not in text:
            unrecorded.append(path.name)
    assert unrecorded == []
