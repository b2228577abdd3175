"""Stand-alone worker: execute a JSON list of programs (stdin), each in a fresh namespace.

Each item is ``{"code": str, "files": {name: text}}``; the program runs in its own fresh
sub-directory holding its files. Run by :func:`eval.sandbox.run_batch` inside the sandbox; imports
nothing of T-Rex. Prints one JSON line with ``{"status", "stdout", "error"}`` per program.
"""

import contextlib
import io
import json
import os
import sys
import traceback


def main() -> None:
    items = json.loads(sys.stdin.read())
    real_stdout = sys.stdout
    root = os.getcwd()
    results = []
    for i, item in enumerate(items):
        code = item["code"]
        wd = os.path.join(root, f"p{i}")
        os.mkdir(wd)
        for name, text in (item.get("files") or {}).items():
            with open(os.path.join(wd, os.path.basename(name)), "w") as f:
                f.write(text)
        os.chdir(wd)
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
        os.chdir(root)
        results.append({"status": status, "stdout": buf.getvalue()[-4000:], "error": error})
    real_stdout.write(json.dumps(results) + "\n")
    real_stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
