"""Runs inside the sandbox (copied there as `_harness.py`): call the solution on each case.

Reads `_cases.json` ({"function", "cases": [[args...], ...], "case_time_s", "marker"}),
imports `solution.py`, calls the function on each case's arguments and prints one line per
case: `<marker> {"i": i, "result": ...}` or `<marker> {"i": i, "error": "..."}`. The expected
results never enter the sandbox; the host compares them. Standard library only, and no
syntax newer than Python 3.8 (the image may carry an older python).
"""

import contextlib
import io
import json
import signal
import sys


class CaseTimeout(Exception):
    pass


def _alarm(_signum, _frame):  # type: ignore[no-untyped-def]
    raise CaseTimeout()


def main() -> None:
    with open("_cases.json") as f:
        spec = json.load(f)
    marker = spec["marker"]
    out = sys.stdout
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink):
            import solution  # the model's code

            fn = getattr(solution, spec["function"])
    except BaseException as e:  # noqa: BLE001  # any failure of the solution is a result to report
        for i in range(len(spec["cases"])):
            out.write(
                marker + " " + json.dumps({"i": i, "error": "import: " + repr(e)[:200]}) + "\n"
            )
        return
    signal.signal(signal.SIGALRM, _alarm)
    for i, args in enumerate(spec["cases"]):
        line: dict = {"i": i}
        try:
            signal.setitimer(signal.ITIMER_REAL, spec["case_time_s"])
            with contextlib.redirect_stdout(sink):
                result = fn(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
            json.dumps(result)
            line["result"] = result
        except BaseException as e:  # noqa: BLE001  # a failing case is data, not a crash
            signal.setitimer(signal.ITIMER_REAL, 0)
            line = {"i": i, "error": repr(e)[:200]}
        sink.seek(0)
        sink.truncate()
        out.write(marker + " " + json.dumps(line) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
