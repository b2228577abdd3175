"""The CLI's OpenMP wait policy: sleeping waiters (PASSIVE) when other processes use the cores, libgomp's
default (spin briefly) on an idle machine, and always the user's own choice."""

from __future__ import annotations

import os
import subprocess
import sys

from trex.cli.common import busy_cores, default_omp_wait_policy


def test_the_policy_is_passive_on_a_busy_or_unknown_machine_and_libgomps_default_on_an_idle_one():
    assert default_omp_wait_policy(1.0) == "PASSIVE"
    assert default_omp_wait_policy(None) == "PASSIVE"  # (cannot tell: the safe choice)
    assert default_omp_wait_policy(0.0) is None


def test_a_process_spinning_on_a_core_is_seen_as_busy():
    spinner = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.write('go\\n'); sys.stdout.flush()\n"
                                                      "while True: pass"], stdout=subprocess.PIPE, text=True)
    try:
        assert spinner.stdout.readline() == "go\n"
        busy = busy_cores(0.3)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and 0.7 <= busy <= (os.cpu_count() or 1) + 0.1


def test_a_policy_the_user_set_is_kept():
    code = "import os, trex.cli.common as c; print(os.environ['OMP_WAIT_POLICY'], c.USER_OMP_WAIT_POLICY)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["ACTIVE", "ACTIVE"]
