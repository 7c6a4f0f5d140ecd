"""The suite's time budget, read from the JUnit file `make test` writes (build/test-results.xml):
wall time per area against its budget (docs/testing.md), the ten slowest tests, and every test
over 60 s. A report, not a failing test: timings on shared 2-core machines are noisy.

It also keeps `make test-fast` fast: tests/slow_tests.txt lists every test that took over
FAST_LIMIT seconds (tests/conftest.py marks them `slow`, which test-fast leaves out). The report
names the tests over the limit that the list misses; `--write-slow`, after a full `make test`,
rewrites the list from the run.

    python .ci/test_report.py [build/test-results.xml] [--write-slow]"""

import collections
import os
import sys
import xml.etree.ElementTree as ET

# docs/testing.md's areas: the files each holds (by name prefix) and its budget in seconds of
# one worker's time (two workers share the 20-minute wall-clock budget: 2400 s in all)
AREAS = {
    "notebooks": (("test_notebooks",), 150),
    "multi-process": (("test_multiprocess", "test_grpo_multiprocess", "test_local_checkpoint"), 420),
    "pairwise checks": (("test_pairs", "test_feature_oracles", "test_compose"), 300),
    "deviceless compiles": (
        ("test_compile", "test_planner", "test_plan_frontier", "test_gpu_", "test_flash_"), 240,
    ),
    "checkpoints and faults": (
        ("test_checkpoint", "test_faults", "test_storage_faults", "test_post_training_kill",
         "test_precision_resume", "test_gcs"), 300,
    ),
}  # fmt: skip
OTHER_BUDGET = 990  # the rest: the budgets add up to 2400 worker seconds (20 minutes on 2 workers)
SLOW = 60.0
# A test of the unit tier (make test-fast) takes at most this long in a full run (setup included)
FAST_LIMIT = 3.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW_LIST = os.path.join(REPO, "tests", "slow_tests.txt")
FILE_TIMES = os.path.join(REPO, "tests", "file_times.txt")
FILE_TIMES_HEADER = """\
# Worker seconds per test file in the last full `make test`: tests/conftest.py hands the longest
# files to the xdist workers first, so that no long file starts last and runs alone at the end.
# Written by `make test-report ARGS=--write-slow`; a file not listed goes last, in its place.
"""
SLOW_LIST_HEADER = f"""\
# Tests over {FAST_LIMIT:.0f} s of a full `make test` (setup included): marked slow, so `make test-fast`
# leaves them out; `make test` runs them. Written by `make test-report ARGS=--write-slow`.
"""


def area(classname: str) -> str:
    name = classname.rsplit(".", 1)[-1]
    for area_name, (prefixes, _) in AREAS.items():
        if name.startswith(prefixes):
            return area_name
    return "everything else"


def listed_slow() -> set[str]:
    if not os.path.exists(SLOW_LIST):
        return set()
    with open(SLOW_LIST) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def main(path: str, write_slow: bool = False) -> int:
    cases, spent = [], collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cases.append((float(case.get("time", 0)), node, area(case.get("classname", ""))))
        for prop in case.iter("property"):  # tests/conftest.py: what the test's process spent on programs
            spent[prop.get("name")] += float(prop.get("value"))
    per_area = collections.defaultdict(float)
    for t, _, a in cases:
        per_area[a] += t
    total = sum(per_area.values())
    print(
        f"{len(cases)} tests, {total:.0f} s of worker time "
        f"(two workers: about {total / 120:.1f} min of wall time)"
    )
    if spent:
        print(
            f"in the test processes (subprocesses not counted): tracing {spent['trace_s']:.0f} s, "
            f"lowering {spent['lower_s']:.0f} s, compiling {spent['compile_s']:.0f} s "
            f"({spent['compiles']:.0f} programs, {spent['cache_hits']:.0f} of them from the cache)"
        )
    print("\nper area (worker seconds, budget):")
    for a, t in sorted(per_area.items(), key=lambda kv: -kv[1]):
        budget = AREAS[a][1] if a in AREAS else OTHER_BUDGET
        over = "  OVER" if budget and t > budget else ""
        print(f"  {a:24} {t:7.0f}" + (f"  / {budget}{over}" if budget else ""))
    print("\nthe ten slowest:")
    for t, node, _ in sorted(cases, reverse=True)[:10]:
        print(f"  {t:6.1f} s  {node}")
    slow = [(t, n) for t, n, _ in cases if t > SLOW]
    print(f"\nover {SLOW:.0f} s: {len(slow)}")
    for t, node in sorted(slow, reverse=True):
        print(f"  {t:6.1f} s  {node}")
    over = {n for t, n, _ in cases if t > FAST_LIMIT}
    fast = [(t, n) for t, n, _ in cases if n not in over]
    print(
        f"\nthe unit tier (tests up to {FAST_LIMIT:.0f} s): {len(fast)} tests, "
        f"{sum(t for t, _ in fast):.0f} s of worker time"
    )
    if write_slow:
        with open(SLOW_LIST, "w") as f:
            f.write(SLOW_LIST_HEADER + "".join(f"{n}\n" for n in sorted(over)))
        print(f"wrote {len(over)} tests to {os.path.relpath(SLOW_LIST)}")
        per_file = collections.Counter()
        for t, node, _ in cases:
            per_file[node.split("::", 1)[0]] += t
        with open(FILE_TIMES, "w") as f:
            f.write(FILE_TIMES_HEADER + "".join(f"{t:.1f} {n}\n" for n, t in per_file.most_common()))
        print(f"wrote {len(per_file)} files' times to {os.path.relpath(FILE_TIMES)}")
    else:
        missing = sorted(over - listed_slow())
        print(f"over {FAST_LIMIT:.0f} s but not in tests/slow_tests.txt: {len(missing)}")
        for node in missing:
            print(f"  {node}")
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--write-slow"]
    sys.exit(main(args[0] if args else "build/test-results.xml", write_slow="--write-slow" in sys.argv))
