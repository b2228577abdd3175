"""Build and load the C++ CPU kernels (``kernels/*_cpu.cpp``) as plain shared libraries called through ctypes.

A kernel source is compiled once per (source, compiler, flags, CPU) with the system C++ compiler (``$CXX``,
else ``g++``, else ``c++``: the compiler torch.compile's CPU backend needs too) into a cache directory
(``$TREX_KERNEL_CACHE``, else ``~/.cache/trex/kernels``, else a folder in the temporary directory), written atomically (concurrent ranks may build at
once), then ``ctypes``-loaded. ``-march=native``: the cache key holds the CPU's model and feature flags, so a
home directory shared by different machines never loads a binary built for another instruction set.

The sources use OpenMP, linked as ``libgomp.so.1``: the dynamic loader hands back the runtime torch already
loaded under that name (one thread pool, not two). No torch headers: a build takes ~2 s, not the ~45 s of a
``torch.utils.cpp_extension``. Where no compiler exists or the build fails, :func:`load` logs why and returns
``None`` and the kernel's ``cpp`` backend is unavailable (the registry falls back to ``reference``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("trex.kernels")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
_SRC_DIR = Path(__file__).resolve().parent


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``g++``, else ``c++`` (``None``: none installed)."""
    for cand in (os.environ.get("CXX", ""), "g++", "c++"):
        if cand and shutil.which(cand):
            return cand
    return None


def cache_dir() -> Path:
    """``$TREX_KERNEL_CACHE``, else ``~/.cache/trex/kernels``, else (a home that cannot be written: CI runners,
    containers) a per-user folder in the temporary directory."""
    if os.environ.get("TREX_KERNEL_CACHE"):
        return Path(os.environ["TREX_KERNEL_CACHE"])
    home = Path.home() / ".cache" / "trex" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"trex-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


@functools.lru_cache(maxsize=None)
def _cpu_fingerprint() -> str:
    """The CPU model and feature flags (what ``-march=native`` compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [ln for ln in info if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def library_path(source: str) -> Path | None:
    """Where the build of ``kernels/<source>`` lives (built or not); ``None`` without a compiler."""
    cxx = compiler()
    if cxx is None:
        return None
    text = (_SRC_DIR / source).read_bytes()
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), _compiler_version(cxx).encode(),
                                     _cpu_fingerprint().encode()])).hexdigest()[:20]
    return cache_dir() / f"{Path(source).stem}-{key}.so"


def build(source: str) -> Path:
    """Compile ``kernels/<source>`` if its build is not cached; returns the library's path. Raises
    ``RuntimeError`` (with the compiler's output) when there is no compiler or the build fails."""
    path = library_path(source)
    if path is None:
        raise RuntimeError(f"no C++ compiler ($CXX, g++ or c++) to build kernels/{source}")
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [compiler(), *FLAGS, str(_SRC_DIR / source), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"building kernels/{source} failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built kernels/%s -> %s", source, path)
    return path


def sources() -> list[str]:
    """The C++ kernel sources of this package (``kernels/*_cpu.cpp``)."""
    return sorted(p.name for p in _SRC_DIR.glob("*_cpu.cpp"))


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether every C++ kernel of this package builds and loads here (the registry's ``cpp`` backend)."""
    return all(load(s) is not None for s in sources())


@functools.lru_cache(maxsize=None)
def load(source: str) -> ctypes.CDLL | None:
    """The ctypes handle of ``kernels/<source>``'s build (built on first use), or ``None`` (logged) if it
    cannot be built or loaded here. Import torch before calling (its OpenMP runtime is the one to share)."""
    try:
        return ctypes.CDLL(str(build(source)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        log.warning("C++ kernel %s unavailable, using the reference: %s", source, e)
        return None


def require(source: str) -> ctypes.CDLL:
    """:func:`load`, or ``RuntimeError`` where the kernel is not built (a backend called without its check)."""
    lib = load(source)
    if lib is None:
        raise RuntimeError(f"the C++ kernel {source} is not built (see the trex.kernels log)")
    return lib
