"""The CPU memory allocator of training processes: tcmalloc where the machine has it, a tuned glibc malloc otherwise.

A training step on the CPU allocates and frees hundreds of activation-sized tensors; glibc's malloc, as it comes,
hands large blocks back to the kernel and faults them in again, page by page, on the next step. Preloading tcmalloc
(``LD_PRELOAD``, the allocator PyTorch's CPU performance guide recommends) keeps them: on 2 vCPUs of an Intel
Xeon (AMX), ``trex bench model --config configs/bench_20m.yaml --dtype bf16`` trained 984-997 tokens/s with glibc
and 1,330-1,379 with tcmalloc, 4.6 -> 3.3 GB peak RSS (jemalloc's defaults were slower than glibc there). Where
there is no tcmalloc, glibc's own settings (``GLIBC_MALLOC``: blocks up to 32 MiB from the heap, not ``mmap``, and
up to 1 GiB of freed heap kept, grown 64 MiB at a time) do most of the same: on 2 vCPUs of an AMD EPYC (AVX-512,
no tcmalloc) the compiled bf16 bench_20m step faulted ~29,000 pages a step as glibc comes and ~540 so tuned.

The choice is made before Python starts, so it is an environment variable, ``TREX_CPU_ALLOCATOR``:

- ``auto`` (default): tcmalloc when the dynamic linker finds it (Debian/Ubuntu: ``apt-get install
  libtcmalloc-minimal4``), else glibc's malloc with ``GLIBC_MALLOC`` (where the C library is glibc), silently;
- ``tcmalloc``: tcmalloc or an error naming the package to install;
- ``glibc``: glibc's malloc with ``GLIBC_MALLOC``, even where tcmalloc is installed;
- ``system``: the C library's allocator as it comes (nothing preloaded, nothing set);
- a path to a shared library: preload that one (another tcmalloc build, jemalloc, ...).

The ``trex`` command re-executes itself once with the allocator set up (:func:`reexec_argv`), and
``trainer.torchrun.launch`` passes it to every rank (:func:`preload_env`). Linux only; elsewhere nothing changes.
A variable already in the environment (``MALLOC_TRIM_THRESHOLD_=...``) is kept. Stdlib only: the CLI calls it
before importing anything heavy.
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
# glibc's malloc settings without tcmalloc (mallopt(3)'s environment names, read when a process starts): blocks up
# to 32 MiB (the largest mmap threshold glibc accepts) come from the heap, whose free top is kept up to 1 GiB and
# grown 64 MiB at a time (without the padding a step still faulted ~3,400 pages)
GLIBC_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                "MALLOC_TOP_PAD_": str(64 << 20)}
GLIBC_TUNED = "glibc-tuned"  # the name :func:`preloaded` and :func:`in_use` give it


class AllocatorError(RuntimeError):
    """``TREX_CPU_ALLOCATOR`` names an allocator this machine does not have."""


def find_tcmalloc() -> str | None:
    """The name the dynamic linker resolves tcmalloc by (``libtcmalloc_minimal.so.4``), or None."""
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def glibc() -> bool:
    """Whether this process's C library is glibc (whose malloc reads ``GLIBC_MALLOC``)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


def _choice(env: Mapping[str, str]) -> str:
    return env.get(ENV, "auto").strip() or "auto"


def wanted_library(env: Mapping[str, str]) -> str | None:
    """The library ``env``'s ``TREX_CPU_ALLOCATOR`` asks to preload (None: the C library's allocator)."""
    choice = _choice(env)
    if choice in ("system", "glibc") or not sys.platform.startswith("linux"):
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
    raise AllocatorError(f"{ENV}={choice!r}: expected auto, tcmalloc, glibc, system or a path to a shared library")


def _preload_list(env: Mapping[str, str]) -> list[str]:
    """``LD_PRELOAD``'s entries (the dynamic linker takes spaces and colons alike)."""
    return env.get("LD_PRELOAD", "").replace(":", " ").split()


def preload_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with the chosen allocator added in front of ``LD_PRELOAD`` (and tcmalloc's large-allocation
    reports off), or with ``GLIBC_MALLOC``'s settings for glibc's malloc; None when there is nothing to add: the
    system allocator, or the library or settings already there."""
    lib = wanted_library(env)  # (looks tcmalloc up once: find_library runs ldconfig)
    # glibc's malloc with GLIBC_MALLOC: asked for (glibc), or auto without tcmalloc
    if lib is None and sys.platform.startswith("linux") and _choice(env) in ("auto", "glibc") and glibc():
        missing = {k: v for k, v in GLIBC_MALLOC.items() if k not in env}
        return {**env, **missing} if missing else None
    there = _preload_list(env)
    if lib is None or any(Path(n).name == Path(lib).name for n in there):
        return None
    out = dict(env)
    out["LD_PRELOAD"] = " ".join([lib, *there])
    if "tcmalloc" in Path(lib).name:
        for k, v in QUIET.items():
            out.setdefault(k, v)
    return out


def _plain(env: Mapping[str, str]) -> str:
    """The name of the C library's allocator in a process started with ``env``: tuned or as it comes."""
    return GLIBC_TUNED if glibc() and all(k in env for k in GLIBC_MALLOC) else "system"


def preloaded(env: Mapping[str, str]) -> str:
    """The allocator ``env``'s ``LD_PRELOAD`` loads into a process started with it; else ``glibc-tuned`` where
    ``env`` sets glibc's malloc as ``GLIBC_MALLOC`` does, or ``system``."""
    lib = next((Path(n).name for n in _preload_list(env) if "malloc" in Path(n).name), None)
    if lib is not None:
        return lib
    return _plain(env)


def for_jobs(env: Mapping[str, str] | None = None) -> str:
    """The allocator ``trainer.torchrun.launch`` gives the ranks it starts from ``env`` (default: this
    process's environment)."""
    env = os.environ if env is None else env
    return preloaded(preload_env(env) or env)


def in_use() -> str:
    """The allocator library loaded in this process (``libtcmalloc_minimal.so.4``, from ``/proc/self/maps``),
    ``glibc-tuned`` (glibc's malloc, started with ``GLIBC_MALLOC``'s settings) or ``system``."""
    plain = _plain(os.environ)
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return plain
    for line in maps.splitlines():
        name = Path(line.split()[-1]).name if "/" in line else ""
        if name.startswith(("libtcmalloc", "libjemalloc", "libmimalloc")):
            return name
    return plain


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
