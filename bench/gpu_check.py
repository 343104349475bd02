"""GPU checks anyone can rerun (issue 28): the GPU-marked tests (tests/sched/test_gpu.py and the
other ``@pytest.mark.gpu`` tests), then bench/trainer_overhead.py --device cuda, and one summary.

On a machine without an NVIDIA GPU every check skips (said in the summary) and the exit status
is 0; a failing test makes it 1.

Usage: make gpu-check   (or: python3 bench/gpu_check.py [--runs 7])
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def run_tests() -> dict[str, Any]:
    """pytest -m gpu over tests/, read back from its JUnit XML: per test, its outcome."""
    with tempfile.TemporaryDirectory(prefix="det-local-gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={xml}", "tests"],
            cwd=REPO,
        )
        outcomes: dict[str, str] = {}
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
                outcome, why = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    found = case.find(tag)
                    if found is not None:
                        outcome = {"failure": "failed", "error": "error"}.get(tag, tag)
                        said = (found.get("message") or "").splitlines()
                        why = said[0][:160] if said else ""
                        break
                outcomes[name] = f"{outcome}{': ' + why if why else ''}"
    return {"returncode": proc.returncode, "tests": outcomes}


def run_bench(runs: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "trainer_overhead.py"), "--device", "cuda",
         "--runs", str(runs)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"trainer_overhead.py failed ({proc.returncode}): {proc.stderr[-500:]}"}
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    tests = run_tests()
    bench = run_bench(args.runs)
    print("\n==== det-local GPU check ====")
    for name, outcome in sorted(tests["tests"].items()):
        print(f"  {outcome.split(':')[0]:8s} {name}{outcome[len(outcome.split(':')[0]) :]}")
    if "skipped" in bench:
        print(f"  skipped  trainer_overhead --device cuda: {bench['skipped']}")
    elif "error" in bench:
        print(f"  failed   trainer_overhead --device cuda: {bench['error']}")
    else:
        for kind, label in (("cuda", "fp32"), ("amp", "AMP ")):
            print(
                f"  bench    {label}: loop {bench[f'{kind}_raw_ms_per_batch']:.4f} ms/batch, "
                f"Trainer {bench[f'{kind}_trainer_ms_per_batch']:.4f} "
                f"(x{bench[f'{kind}_ratio']}; target <= x1.02: "
                f"{'met' if bench[f'{kind}_within_target'] else 'NOT met'}) on {bench['device']}"
            )
    counts: dict[str, int] = {}
    for outcome in tests["tests"].values():
        key = outcome.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    ok = tests["returncode"] in (0, 5) and "error" not in bench  # 5: no test collected
    print(f"  => {'OK' if ok else 'FAILED'} {counts}")
    print(json.dumps({"ok": ok, "counts": counts, "tests": tests["tests"], "bench": bench}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
