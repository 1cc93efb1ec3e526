#!/usr/bin/env bash
# The slow tier, nightly: every test marked `slow` (600 s of the chaos schedule, every fault
# kind twice or more; the 60 s partition, SmolLM2's conversion, merge exactness on SmolLM2,
# ...), then a summary. CI (.ci/run) runs the default tier, which includes one round of every
# fault kind (`jetctl chaos --faults 7`); this runs the rest. Needs what .ci/run sets up (./scripts/setup.sh,
# ./scripts/ci-services.sh for the docker and browser tiers).
# Usage: ./scripts/nightly.sh [extra pytest args]   (exit status: pytest's)
set -uo pipefail
cd "$(dirname "$0")/.."
export CI=${CI:-true}
./scripts/setup.sh || exit 1
out=$(mktemp -d)
start=$(date +%s)
.venv/bin/python -m pytest -m "slow and not gpu" -p no:cacheprovider \
  --junitxml="$out/slow.xml" "$@" 2>&1 | tee "$out/slow.log"
rc=${PIPESTATUS[0]}
took=$(( $(date +%s) - start ))
echo
echo "== nightly: slow tier in ${took}s, exit $rc =="
.venv/bin/python - "$out/slow.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
cases = suite.findall("testcase")
for case in sorted(cases, key=lambda c: -float(c.get("time", 0))):
    verdict = "failed" if case.find("failure") is not None or case.find("error") is not None \
        else "skipped" if case.find("skipped") is not None else "passed"
    print(f"{verdict:8} {float(case.get('time', 0)):7.1f}s  {case.get('classname')}::{case.get('name')}")
print(f"{len(cases)} tests: {suite.get('failures')} failed, {suite.get('errors')} errors, "
      f"{suite.get('skipped')} skipped")
PY
exit "$rc"
