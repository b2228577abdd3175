import ctypes
import logging

import pytest

from kernels import cpp_build

GOOD = '#include <omp.h>\nextern "C" int threads_seen(int n) {\n  int seen = 0;\n#pragma omp parallel num_threads(n)\n' \
       '  {\n#pragma omp atomic\n    seen += 1;\n  }\n  return seen;\n}\n'


@pytest.fixture
def src(tmp_path, monkeypatch):
    """A private source folder and cache (the real kernels' builds are left alone)."""
    (tmp_path / "src").mkdir()
    monkeypatch.setattr(cpp_build, "_SRC_DIR", tmp_path / "src")
    monkeypatch.setenv("TREX_KERNEL_CACHE", str(tmp_path / "cache"))
    cpp_build.load.cache_clear()
    yield tmp_path / "src"
    cpp_build.load.cache_clear()


def test_builds_once_into_the_cache_and_uses_openmp(src):
    (src / "toy_cpu.cpp").write_text(GOOD)
    path = cpp_build.build("toy_cpu.cpp")
    assert path.parent == src.parent / "cache" and path.exists()
    stamp = path.stat().st_mtime_ns
    assert cpp_build.build("toy_cpu.cpp") == path and path.stat().st_mtime_ns == stamp  # cached, not rebuilt
    lib = cpp_build.load("toy_cpu.cpp")
    lib.threads_seen.argtypes, lib.threads_seen.restype = [ctypes.c_int], ctypes.c_int
    assert lib.threads_seen(2) == 2
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_the_key_follows_the_source(src):
    (src / "toy_cpu.cpp").write_text(GOOD)
    first = cpp_build.library_path("toy_cpu.cpp")
    (src / "toy_cpu.cpp").write_text(GOOD + "\n// changed\n")
    assert cpp_build.library_path("toy_cpu.cpp") != first


def test_a_failed_build_names_the_source_and_leaves_the_backend_unavailable(src, caplog):
    (src / "bad_cpu.cpp").write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="building kernels/bad_cpu.cpp failed"):
        cpp_build.build("bad_cpu.cpp")
    with caplog.at_level(logging.WARNING, logger="trex.kernels"):
        assert cpp_build.load("bad_cpu.cpp") is None
    assert "bad_cpu.cpp unavailable" in caplog.text
    assert not list((src.parent / "cache").glob("*.so"))


def test_no_compiler(src, monkeypatch):
    (src / "toy_cpu.cpp").write_text(GOOD)
    monkeypatch.setattr(cpp_build, "compiler", lambda: None)
    assert cpp_build.library_path("toy_cpu.cpp") is None
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpp_build.build("toy_cpu.cpp")
    assert cpp_build.load("toy_cpu.cpp") is None


def test_an_unwritable_home_falls_back_to_the_temporary_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("a file where the cache folder would go")  # mkdir fails, even for root
    monkeypatch.delenv("TREX_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(cpp_build.Path, "home", staticmethod(lambda: home))
    monkeypatch.setattr(cpp_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    got = cpp_build.cache_dir()
    assert got.parent == tmp_path / "tmp" and got.name.startswith("trex-kernels-")
    (home / ".cache").unlink()
    assert cpp_build.cache_dir() == home / ".cache" / "trex" / "kernels"  # a writable home is used
    monkeypatch.setenv("TREX_KERNEL_CACHE", str(tmp_path / "env"))
    assert cpp_build.cache_dir() == tmp_path / "env"
