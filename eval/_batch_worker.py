"""Stand-alone worker: execute a JSON list of programs (stdin), each in a fresh namespace.

Run by :func:`eval.sandbox.run_batch` inside the sandbox; imports nothing of T-Rex. Prints one JSON
line with ``{"status", "stdout", "error"}`` per program.
"""

import contextlib
import io
import json
import os
import sys
import traceback


def main() -> None:
    codes = json.loads(sys.stdin.read())
    real_stdout = sys.stdout
    results = []
    for i, code in enumerate(codes):
        buf = io.StringIO()
        status, error = "ok", ""
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(code, f"<program {i}>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            if e.code not in (None, 0):
                status, error = "error", f"SystemExit({e.code})"
        except BaseException:  # noqa: BLE001 - report every failure of an untrusted program
            status, error = "error", traceback.format_exc(limit=3)[-600:]
        results.append({"status": status, "stdout": buf.getvalue()[-4000:], "error": error})
    real_stdout.write(json.dumps(results) + "\n")
    real_stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
