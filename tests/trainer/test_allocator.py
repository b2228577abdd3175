"""``trainer/allocator.py``: which allocator a training process gets, and the ``trex`` command's one re-execution
with it preloaded (a stand-in library built here records each process it is loaded into)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import allocator

ROOT = Path(__file__).resolve().parents[2]
MARKER_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void loaded(void) {
    const char *path = getenv("FAKE_ALLOCATOR_MARK");
    if (path) { FILE *f = fopen(path, "a"); if (f) { fputs("loaded\n", f); fclose(f); } }
}
"""


@pytest.fixture
def found(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")


def test_auto_preloads_tcmalloc_in_front_of_what_is_there_and_quiets_its_reports(found):
    env = allocator.preload_env({"LD_PRELOAD": "libfoo.so:libbar.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 libfoo.so libbar.so"
    assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == str(1 << 40) and env["PATH"] == "/bin"
    assert allocator.preloaded(env) == "libtcmalloc_minimal.so.4"
    assert allocator.for_jobs({"PATH": "/bin"}) == "libtcmalloc_minimal.so.4"  # what launch gives ranks
    assert allocator.preload_env(env) is None  # already there: nothing to add (no second re-execution)
    assert allocator.preload_env({allocator.ENV: "system"}) is None


def test_without_tcmalloc_auto_tunes_glibc_and_tcmalloc_says_what_to_install(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.setattr(allocator, "glibc", lambda: True)
    env = allocator.preload_env({"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "0"})
    assert env == {"PATH": "/bin", **allocator.GLIBC_MALLOC, "MALLOC_TRIM_THRESHOLD_": "0"}  # the user's value kept
    assert "LD_PRELOAD" not in env and allocator.preloaded(env) == allocator.GLIBC_TUNED
    assert allocator.preload_env(env) is None  # already set: no second re-execution
    assert allocator.for_jobs({}) == allocator.GLIBC_TUNED  # what launch gives ranks
    assert allocator.preloaded({}) == "system"
    with pytest.raises(allocator.AllocatorError, match="apt-get install libtcmalloc-minimal4"):
        allocator.preload_env({allocator.ENV: "tcmalloc"})


def test_system_is_the_c_library_as_it_comes_and_glibc_is_chosen_over_tcmalloc(found, monkeypatch):
    monkeypatch.setattr(allocator, "glibc", lambda: True)
    assert allocator.preload_env({allocator.ENV: "system"}) is None
    assert allocator.for_jobs({allocator.ENV: "system"}) == "system"
    env = allocator.preload_env({allocator.ENV: "glibc"})
    assert "LD_PRELOAD" not in env and all(env[k] == v for k, v in allocator.GLIBC_MALLOC.items())
    monkeypatch.setattr(allocator, "glibc", lambda: False)  # another C library (musl): nothing to tune
    assert allocator.preload_env({allocator.ENV: "glibc"}) is None


def test_a_library_path_is_preloaded_and_a_bad_choice_is_named(tmp_path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    assert allocator.preload_env({allocator.ENV: str(lib)})["LD_PRELOAD"] == str(lib)
    with pytest.raises(allocator.AllocatorError, match="no-such.so: no such file"):
        allocator.preload_env({allocator.ENV: str(tmp_path / "no-such.so")})
    with pytest.raises(allocator.AllocatorError, match="'jemalloc': expected auto, tcmalloc, glibc, system"):
        allocator.preload_env({allocator.ENV: "jemalloc"})


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory) -> Path:
    """A shared library named like tcmalloc whose constructor appends a line to ``$FAKE_ALLOCATOR_MARK``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in allocator library")
    d = tmp_path_factory.mktemp("fake_allocator")
    (d / "mark.c").write_text(MARKER_C)
    lib = d / "libtcmalloc_standin.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(d / "mark.c")], check=True)
    return lib


ENTRIES = {"console script": [str(Path(sys.executable).with_name("trex"))],
           "python -m trex": [sys.executable, "-m", "trex"]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD: Linux only")
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_the_trex_command_runs_once_more_with_the_allocator_and_only_once(fake_lib, tmp_path, entry):
    if not Path(ENTRIES[entry][0]).exists():
        pytest.fail(f"no {ENTRIES[entry][0]}: the package is not installed in this interpreter's environment")

    def _trex(args: list[str], env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([*ENTRIES[entry], *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)

    mark = tmp_path / "mark"
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"FAKE_ALLOCATOR_MARK": str(mark)}
    out = _trex(["config", "--config", "configs/tiny.yaml"], base | {allocator.ENV: str(fake_lib)})
    assert out.returncode == 0, out.stderr
    assert "hidden_size" in out.stdout  # the command itself ran, after the re-execution
    assert mark.read_text() == "loaded\n"  # loaded into exactly one process: one re-execution, no loop
    mark.unlink()
    assert _trex(["config", "--config", "configs/tiny.yaml"], base | {allocator.ENV: "system"}).returncode == 0
    assert not mark.exists()
    bad = _trex(["--help"], base | {allocator.ENV: str(tmp_path / "missing.so")})
    assert bad.returncode == 2 and "missing.so: no such file" in bad.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps: Linux only")
def test_in_use_names_the_allocator_loaded_in_the_process(fake_lib):
    code = "from trainer.allocator import in_use; print(in_use())"
    env = {**os.environ, "LD_PRELOAD": str(fake_lib), "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "libtcmalloc_standin.so"
    env.pop("LD_PRELOAD")
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "system"


FAULTS = r"""
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 8 << 20  # activation-sized blocks
faults = []
for _ in range(5):  # a "step": four blocks allocated and written, then all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(4)]
    for p in blocks:
        ctypes.memset(p, 1, size)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    for p in blocks:
        libc.free(p)
print(min(faults[2:]))  # after glibc's own threshold adjustment (its first frees)
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and allocator.glibc()), reason="glibc's malloc only")
def test_tuned_glibc_keeps_freed_blocks_where_glibc_as_it_comes_faults_them_in_again():
    def faults(env: dict) -> int:
        return int(subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True,
                                  check=True).stdout)

    plain = {k: v for k, v in os.environ.items() if k not in allocator.GLIBC_MALLOC and k != "LD_PRELOAD"}
    assert faults(plain) >= 4000  # glibc as it comes: the freed heap top (32 MiB) went back to the kernel
    tuned = allocator.preload_env({**plain, allocator.ENV: "glibc"})
    assert faults(tuned) < 100
