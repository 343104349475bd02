"""det-local run overhead: `det-local run` of a config whose entrypoint is `python3 -c "print(1)"`
against running that command directly, in the same run. Target: det_local_ms - direct_ms <= 400.

Usage: python3 bench/run_overhead.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import det_local_cmd, env_with_home, median, timed  # noqa: E402

CONFIG = """\
name: overhead
entrypoint: python3 -c "print(1)"
searcher: {name: single, metric: x, max_length: 1}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp:
        ctx = os.path.join(tmp, "ctx")
        os.makedirs(ctx)
        with open(os.path.join(ctx, "config.yaml"), "w") as f:
            f.write(CONFIG)
        env = env_with_home(os.path.join(tmp, "home"))
        direct_cmd = ["python3", "-c", "print(1)"]
        det_cmd = [*det_local_cmd(), "run", "config.yaml", "."]
        timed(direct_cmd, env, ctx)
        timed(det_cmd, env, ctx)  # warm-up: creates the store
        direct, det = [], []
        for _ in range(args.runs):  # interleaved, so noise hits both alike
            direct.append(timed(direct_cmd, env, ctx))
            det.append(timed(det_cmd, env, ctx))
    result = {
        "direct_ms": median(direct),
        "det_local_ms": median(det),
        "overhead_ms": round(median(det) - median(direct), 2),
        "runs": args.runs,
        "target_overhead_ms": 400,
    }
    print(f"direct {result['direct_ms']} ms, det-local run {result['det_local_ms']} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
