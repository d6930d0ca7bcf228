"""The suite's CUDA-marked tests as rows of the device check's report, from the JUnit XML pytest wrote: each one
PASS, FAIL, or NOT RUN with pytest's reason. A skip is not a pass: on a lent GPU, a test that skipped proved
nothing, and the report says which and why."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from bench.device_checks.common import Result


def cuda_test_results(xml: Path, exit_code: int) -> list[Result]:
    """One Result a test case; one failing Result when pytest wrote no report (it crashed, or ran out of time)
    or failed without a failing case (an error at collection)."""
    if not xml.exists():
        r = Result("cuda_tests", "The CUDA-marked tests", "pytest runs them and writes its report", passed=False)
        r.notes.append(f"no JUnit report at {xml}: pytest exited {exit_code} (cut short by its time limit?)")
        return [r]
    results = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        r = Result(name, f"test {name}", "passes", seconds=float(case.get("time", 0)))
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            r.passed = False
            r.notes.append((failed.get("message") or failed.text or "failed").strip().splitlines()[0][:500])
        elif skipped is not None:
            r.skip(skipped.get("message") or "skipped")
        else:
            r.passed = True
        results.append(r)
    if exit_code not in (0, 1, 5) or (exit_code == 1 and all(r.passed is not False for r in results)):
        r = Result("cuda_tests", "The CUDA-marked tests", "pytest ends without an error", passed=False)
        r.notes.append(f"pytest exited {exit_code} (a collection error or an internal one: see its log)")
        results.append(r)
    return results
