"""Run every fuzz target of tests/fuzz for a while and print what each found.

    python bench/fuzz.py --minutes 10        # the time split across the targets
    python bench/fuzz.py --only http_server_smuggling --minutes 2
    python bench/fuzz.py --quick             # a few seconds each (make bench-quick)

Per target: cases tried, failures (a property that did not hold), crashes
(an exception llmgw's code let escape), 5xx answers to valid or invalid
input, hangs, and the first examples of each. The last line of the output
is the whole result as one JSON object; the exit status is 1 if anything
was found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.fuzz.runner import run  # noqa: E402
from tests.fuzz.targets import ALL  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0,
                        help="total time, split evenly across the targets (default 2)")
    parser.add_argument("--only", action="append", default=[],
                        help="run only this target (repeatable)")
    parser.add_argument("--quick", action="store_true", help="3 s per target")
    args = parser.parse_args()
    targets = [t for t in ALL if not args.only or t.name in args.only]
    unknown = set(args.only) - {t.name for t in ALL}
    if unknown:
        parser.error(f"no such target: {', '.join(sorted(unknown))}"
                     f" (targets: {', '.join(t.name for t in ALL)})")
    per_target = 3.0 if args.quick else args.minutes * 60.0 / len(targets)
    started = time.monotonic()
    results = {}
    for target in targets:
        stats = run(target, per_target)
        results[target.name] = stats.as_dict()
        print(f"{target.name:32} cases {stats.cases:7d}  failures {stats.failures}"
              f"  crashes {stats.crashes}  5xx {stats.server_errors}  hangs {stats.hangs}"
              f"  ({stats.seconds:.0f} s)", flush=True)
        for example in stats.examples:
            print("    " + example.replace("\n", "\n    "), flush=True)
    found = sum(r["failures"] + r["crashes"] + r["5xx"] + r["hangs"] for r in results.values())
    summary = {"seconds": round(time.monotonic() - started), "per_target_s": round(per_target, 1),
               "found": found, "targets": results}
    print(json.dumps(summary))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
