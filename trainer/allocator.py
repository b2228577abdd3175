"""The CPU memory allocator of training processes: tcmalloc where the machine has it, glibc's malloc otherwise.

A training step on the CPU allocates and frees hundreds of activation-sized tensors; glibc's malloc hands large
blocks back to the kernel and faults them in again, page by page, on the next step. Preloading tcmalloc
(``LD_PRELOAD``, the allocator PyTorch's CPU performance guide recommends) keeps them: on 2 vCPUs of an Intel
Xeon (AMX), ``trex bench model --config configs/bench_20m.yaml --dtype bf16`` trained 984-997 tokens/s with glibc
and 1,330-1,379 with tcmalloc, 4.6 -> 3.3 GB peak RSS (jemalloc's defaults were slower than glibc there).

The choice is made before Python starts, so it is an environment variable, ``TREX_CPU_ALLOCATOR``:

- ``auto`` (default): tcmalloc when the dynamic linker finds it (Debian/Ubuntu: ``apt-get install
  libtcmalloc-minimal4``), else the system allocator, silently;
- ``tcmalloc``: tcmalloc or an error naming the package to install;
- ``system``: never preload;
- a path to a shared library: preload that one (another tcmalloc build, jemalloc, ...).

The ``trex`` command re-executes itself once with the allocator preloaded (:func:`reexec_argv`), and
``trainer.torchrun.launch`` passes it to every rank (:func:`preload_env`). Linux only; elsewhere nothing changes.
Stdlib only: the CLI calls it before importing anything heavy.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV = "TREX_CPU_ALLOCATOR"
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")  # libtcmalloc_minimal.so.4 (no profiler) first
# tcmalloc reports every allocation over 1 GiB on stderr ("tcmalloc: large alloc ..."); loading a real checkpoint
# makes many: report none below 1 TiB
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


class AllocatorError(RuntimeError):
    """``TREX_CPU_ALLOCATOR`` names an allocator this machine does not have."""


def find_tcmalloc() -> str | None:
    """The name the dynamic linker resolves tcmalloc by (``libtcmalloc_minimal.so.4``), or None."""
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def wanted_library(env: Mapping[str, str]) -> str | None:
    """The library ``env``'s ``TREX_CPU_ALLOCATOR`` asks to preload (None: the system allocator)."""
    choice = env.get(ENV, "auto").strip() or "auto"
    if choice == "system" or not sys.platform.startswith("linux"):
        return None
    if choice in ("auto", "tcmalloc"):
        lib = find_tcmalloc()
        if lib is None and choice == "tcmalloc":
            raise AllocatorError(f"{ENV}=tcmalloc: no libtcmalloc on this machine (Debian/Ubuntu: apt-get install "
                                 f"libtcmalloc-minimal4), or set {ENV}=system")
        return lib
    if "/" in choice:
        if not Path(choice).is_file():
            raise AllocatorError(f"{ENV}={choice}: no such file")
        return choice
    raise AllocatorError(f"{ENV}={choice!r}: expected auto, tcmalloc, system or a path to a shared library")


def _preload_list(env: Mapping[str, str]) -> list[str]:
    """``LD_PRELOAD``'s entries (the dynamic linker takes spaces and colons alike)."""
    return env.get("LD_PRELOAD", "").replace(":", " ").split()


def preload_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with the chosen allocator added in front of ``LD_PRELOAD`` (and tcmalloc's large-allocation
    reports off), or None when there is nothing to add: the system allocator, or the library already there."""
    lib = wanted_library(env)
    there = _preload_list(env)
    if lib is None or any(Path(n).name == Path(lib).name for n in there):
        return None
    out = dict(env)
    out["LD_PRELOAD"] = " ".join([lib, *there])
    if "tcmalloc" in Path(lib).name:
        for k, v in QUIET.items():
            out.setdefault(k, v)
    return out


def preloaded(env: Mapping[str, str]) -> str:
    """The allocator ``env``'s ``LD_PRELOAD`` loads into a process started with it, or ``system``."""
    return next((Path(n).name for n in _preload_list(env) if "malloc" in Path(n).name), "system")


def for_jobs(env: Mapping[str, str] | None = None) -> str:
    """The allocator ``trainer.torchrun.launch`` gives the ranks it starts from ``env`` (default: this
    process's environment)."""
    env = os.environ if env is None else env
    return preloaded(preload_env(env) or env)


def in_use() -> str:
    """The allocator library loaded in this process (``libtcmalloc_minimal.so.4``, from ``/proc/self/maps``),
    or ``system`` (glibc's malloc, or a platform without ``/proc``)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    for line in maps.splitlines():
        name = Path(line.split()[-1]).name if "/" in line else ""
        if name.startswith(("libtcmalloc", "libjemalloc", "libmimalloc")):
            return name
    return "system"


def reexec_argv() -> list[str]:
    """The command line that starts this process again: the interpreter, its options, the script and its
    arguments (``sys.orig_argv``: ``-m trex ...`` and console scripts alike)."""
    return [sys.executable, *sys.orig_argv[1:]]


def reexec_with_allocator(drop: tuple[str, ...] = ()) -> None:
    """Replace this process by itself with the allocator preloaded, when there is one to add (else return);
    ``drop``: variables this process set for itself that the new one should decide afresh. A failed ``exec``
    leaves the process running as it was; an impossible explicit choice raises."""
    env = preload_env(os.environ)
    if env is None:
        return
    for k in drop:
        env.pop(k, None)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, reexec_argv(), env)
    except OSError:
        return
