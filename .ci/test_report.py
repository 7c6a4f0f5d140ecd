"""The suite's time budget, read from the JUnit file `make test` writes (build/test-results.xml):
wall time per area against its budget (docs/testing.md), the ten slowest tests, and every test
over 60 s. A report, not a failing test: timings on shared 2-core machines are noisy.

    python .ci/test_report.py [build/test-results.xml]"""

import collections
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


def area(classname: str) -> str:
    name = classname.rsplit(".", 1)[-1]
    for area_name, (prefixes, _) in AREAS.items():
        if name.startswith(prefixes):
            return area_name
    return "everything else"


def main(path: str) -> int:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cases.append((float(case.get("time", 0)), node, area(case.get("classname", ""))))
    per_area = collections.defaultdict(float)
    for t, _, a in cases:
        per_area[a] += t
    total = sum(per_area.values())
    print(
        f"{len(cases)} tests, {total:.0f} s of worker time "
        f"(two workers: about {total / 120:.1f} min of wall time)"
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/test-results.xml"))
