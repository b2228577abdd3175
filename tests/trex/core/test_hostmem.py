"""Freed memory stays in the process (glibc malloc), so a step that allocates and frees the same buffers does not
fault their pages in again; and the user's own settings win."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from trex.core.hostmem import ENV, keep_freed_memory

ROUNDS = """
import json, resource, sys
from trex.core.hostmem import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def step():  # eight 8 MiB activations, every page written, then all freed
    bufs = [bytearray(8 << 20) for _ in range(8)]
    for b in bufs:
        b[::4096] = bytes(len(range(0, len(b), 4096)))
for _ in range(2):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ENV and k != "TREX_MALLOC"}
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    return json.loads(out.stdout)


def test_freed_buffers_are_reused_without_page_faults():
    kept, default = _run("keep"), _run("default")
    assert kept["applied"] and not default["applied"]
    pages = 3 * 8 * (8 << 20) // 4096  # what three steps fault in when the heap is trimmed between them
    assert default["faults"] > pages // 2, default  # (glibc's default trims: the effect is measurable here)
    assert kept["faults"] < pages // 20, kept


def test_the_settings_reach_child_processes_and_the_users_choice_wins():
    env: dict = {}
    assert keep_freed_memory(env)
    assert env == {k: str(v) for k, v in ENV.items()}
    mine = {"MALLOC_TRIM_THRESHOLD_": "0"}
    assert not keep_freed_memory(mine) and mine == {"MALLOC_TRIM_THRESHOLD_": "0"}
    opted_out = {"TREX_MALLOC": "default"}
    assert not keep_freed_memory(opted_out) and opted_out == {"TREX_MALLOC": "default"}
