"""Kernel registry: one implementation per (op, backend); the caller's device picks the backend.

Backends (see ``docs/kernels.md``):

- ``reference``: plain torch, always available, the numerical definition of every op (CPU path);
- ``triton``: Triton kernels (forward and backward as ``torch.autograd.Function``) on CUDA, on Ascend NPUs
  through triton-ascend, and on CPU only under ``TRITON_INTERPRET=1`` (tests) when explicitly forced;
- ``torch_npu``: Ascend's fused ops (``torch_npu.npu_*``), only ever checked and imported on ``npu``;
- ``cpp``: C++ CPU kernels (``kernels/*_cpu.cpp``, built with the system compiler on first check and cached:
  ``kernels/cpp_build.py``), available on ``cpu`` where they all build, else the ops run ``reference``.

Selection for ``get(op, device_type)``: the first override that applies, else the first backend of
``PREFERENCE[device_type]`` that the op registers and that is available. Overrides, most specific first
(programmatic beats the environment at equal specificity):

1. ``set_overrides({op: backend})`` / ``use_backends(op=backend)``;
2. env ``TREX_KERNEL_<OP>=<backend>`` (``OP`` upper-case, e.g. ``TREX_KERNEL_RMS_NORM=reference``);
3. ``set_overrides({"*": backend})`` / ``use_backends(backend)``;
4. env ``TREX_KERNEL_BACKEND=<backend>``.

A per-op override must name a backend the op registers and that is available on the device, else
``KeyError``. An all-ops override (3, 4) applies to the ops that register that backend (the others keep
their preference) and raises ``KeyError`` for an op whose registered backend is unavailable on the device.
Each choice is logged once per (op, device, backend) on ``logging.getLogger("trex.kernels")``;
``choices()`` returns the picks so far (for MLflow params).

Nothing here imports triton or torch_npu at import time; availability checks import them on first need.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
from typing import Any, Callable, Iterator, Mapping

log = logging.getLogger("trex.kernels")

BACKENDS = ("reference", "triton", "torch_npu", "cpp")
PREFERENCE: dict[str, tuple[str, ...]] = {
    "npu": ("torch_npu", "triton", "reference"),
    "cuda": ("triton", "reference"),
    "cpu": ("cpp", "reference"),  # triton on CPU: only when forced, under TRITON_INTERPRET=1
}
ALL_OPS = "*"
ENV_ALL = "TREX_KERNEL_BACKEND"

_IMPLS: dict[str, dict[str, Callable]] = {}
_AVAILABLE: dict[str, Callable[[str], bool]] = {}
_OVERRIDES: dict[str, str] = {}
_CHOICES: dict[tuple[str, str], str] = {}
_LOGGED: set[tuple[str, str, str]] = set()


# ------------------------------------------------------------------------------------------ availability
@functools.lru_cache(maxsize=None)
def _importable(module: str) -> bool:
    """Whether ``module`` imports (cached; imports it on first call)."""
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a broken install is an unavailable backend
        log.warning("kernel backend module %s is installed but does not import: %s", module, e)
        return False
    return True


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def triton_interpret() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _env_true("TRITON_INTERPRET")


@functools.lru_cache(maxsize=None)
def _triton_ascend() -> bool:
    """triton-ascend installed: its distribution, or an Ascend backend plugin inside ``triton.backends``."""
    for dist in ("triton-ascend", "triton_ascend"):
        try:
            importlib.metadata.distribution(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        import triton.backends as tb

        return any(name in getattr(tb, "backends", {}) for name in ("ascend", "cann"))
    except Exception:  # noqa: BLE001
        return False


def _triton_available(device_type: str) -> bool:
    if device_type == "cuda":
        return _importable("triton")
    if device_type == "npu":
        return _importable("triton") and _triton_ascend()
    if device_type == "cpu":
        return triton_interpret() and _importable("triton")
    return False


def _torch_npu_available(device_type: str) -> bool:
    return device_type == "npu" and _importable("torch_npu")


def register_backend(backend: str, available: Callable[..., bool]) -> None:
    """Declare a backend; ``available(device_type)`` (or ``available()``) says whether it can run there."""
    try:
        takes_device = len(inspect.signature(available).parameters) >= 1
    except (TypeError, ValueError):
        takes_device = True
    _AVAILABLE[backend] = available if takes_device else (lambda _device_type, _f=available: _f())


register_backend("reference", lambda device_type: True)
register_backend("triton", _triton_available)
register_backend("torch_npu", _torch_npu_available)


def _cpp_available(device_type: str) -> bool:
    if device_type != "cpu":
        return False
    from kernels import cpp_build  # (builds the C++ kernels on the first check: ~1.3 s each, then cached on disk)

    return cpp_build.available()


register_backend("cpp", _cpp_available)


def is_available(backend: str, device_type: str) -> bool:
    check = _AVAILABLE.get(backend)
    return bool(check and check(device_type))


# ------------------------------------------------------------------------------------------ registration
_EAGER: dict[tuple[str, str], Callable] = {}  # functions torch.compile must not trace (data-dependent control flow)
_DISABLED: dict[tuple[str, str], Callable] = {}  # their torch.compiler.disable'd wrappers (made by resolve_all)
_TRACED: dict[tuple[str, str], Callable] = {}  # what torch.compile traces instead of an implementation


def run_eagerly(key: tuple[str, str], fn: Callable) -> Callable:
    """Mark ``fn`` as one that compiled code calls eagerly (its control flow depends on tensor values);
    :func:`eager_version` then returns its ``torch.compiler.disable`` wrapper, made by :func:`resolve_all`
    (not here: that imports torch._dynamo, and with it triton). ``key``: ``(op, backend)`` for a registered
    implementation, ``(module, name)`` for any other function. Returns ``fn``."""
    _EAGER[key] = fn
    return fn


def eager_version(key: tuple[str, str], fn: Callable) -> Callable:
    """While torch.compile traces: ``fn``'s eager wrapper, if :func:`run_eagerly` marked it and
    :func:`resolve_all` made one, else the function registered as ``traced`` for it; otherwise (and always
    outside compilation) ``fn`` itself."""
    return (_DISABLED.get(key) or _TRACED.get(key) or fn) if _compiling() else fn


def register(op: str, backend: str, eager: bool = False, traced: Callable | None = None
             ) -> Callable[[Callable], Callable]:
    """Decorator: ``@register("rms_norm", "triton")`` registers ``fn`` as that op's implementation. ``eager``:
    ``fn``'s control flow depends on tensor values (host syncs), so compiled code calls it eagerly. ``traced``:
    what torch.compile traces in ``fn``'s place once the op's backend is chosen (:func:`resolve_all`): an
    eager-only speed-up (an autograd Function with a hand-written backward) hands the compiler the op's
    definition, which inductor fuses itself."""

    def deco(fn: Callable) -> Callable:
        _IMPLS.setdefault(op, {})[backend] = fn
        if eager:
            run_eagerly((op, backend), fn)
        if traced is not None:
            set_traced(op, backend, traced)
        return fn

    return deco


def traced(op: str, backend: str) -> Callable | None:
    """The function compiled code traces in place of ``op``'s ``backend`` (``register(..., traced=)``), if any."""
    return _TRACED.get((op, backend))


def set_traced(op: str, backend: str, fn: Callable | None) -> None:
    """Make compiled code trace ``fn`` in place of ``op``'s ``backend`` (``None``: the implementation itself)."""
    if fn is None:
        _TRACED.pop((op, backend), None)
    else:
        _TRACED[(op, backend)] = fn


def backends(op: str) -> list[str]:
    """The backends registered for ``op`` (whatever the device)."""
    return sorted(_IMPLS.get(op, {}))


def ops() -> list[str]:
    return sorted(_IMPLS)


def available(op: str, device_type: str) -> list[str]:
    """The backends of ``op`` that can run on ``device_type``, in preference order (then the rest)."""
    impls = _IMPLS.get(op, {})
    order = list(PREFERENCE.get(device_type, ())) + sorted(b for b in impls if b not in PREFERENCE.get(device_type, ()))
    return [b for b in order if b in impls and is_available(b, device_type)]


# ------------------------------------------------------------------------------------------ overrides
def _check_backend(backend: str, where: str) -> None:
    if backend not in _AVAILABLE:
        raise KeyError(f"{where}: unknown kernel backend {backend!r}; known: {sorted(_AVAILABLE)}")


def set_overrides(overrides: Mapping[str, str] | None) -> dict[str, str]:
    """Replace the programmatic overrides (``{op_or_"*": backend}``; ``None`` clears); returns the old ones."""
    new = dict(overrides or {})
    for op, backend in new.items():
        _check_backend(backend, f"override for {op!r}")
    old = dict(_OVERRIDES)
    _OVERRIDES.clear()
    _OVERRIDES.update(new)
    return old


def overrides() -> dict[str, str]:
    return dict(_OVERRIDES)


@contextlib.contextmanager
def use_backends(all_ops: str | None = None, /, **per_op: str) -> Iterator[None]:
    """Temporarily override: ``use_backends("reference")`` for every op, ``use_backends(rms_norm="triton")``
    for one (both can be combined); the previous overrides are restored on exit."""
    new = dict(_OVERRIDES)
    if all_ops is not None:
        new[ALL_OPS] = all_ops
    new.update(per_op)
    old = set_overrides(new)
    try:
        yield
    finally:
        set_overrides(old)


def _env_op(op: str) -> str:
    return "TREX_KERNEL_" + op.upper()


def _forced(op: str) -> tuple[str | None, str, bool]:
    """(backend, where it came from, per-op?) of the override applying to ``op``, most specific first."""
    if op in _OVERRIDES:
        return _OVERRIDES[op], f"set_overrides[{op!r}]", True
    env = os.environ.get(_env_op(op), "").strip()
    if env:
        return env, _env_op(op), True
    if ALL_OPS in _OVERRIDES:
        return _OVERRIDES[ALL_OPS], "set_overrides['*']", False
    env = os.environ.get(ENV_ALL, "").strip()
    if env:
        return env, ENV_ALL, False
    return None, "", False


# ------------------------------------------------------------------------------------------ selection
def select(op: str, device_type: str = "cpu") -> str:
    """The backend ``get`` would use for ``op`` on ``device_type`` (records and logs the choice)."""
    impls = _IMPLS.get(op)
    if not impls:
        raise KeyError(f"no kernel registered for op {op!r}; known: {sorted(_IMPLS)}")
    forced, source, per_op = _forced(op)
    backend = None
    if forced:
        _check_backend(forced, source)
        if forced in impls or per_op:
            if forced not in impls or not is_available(forced, device_type):
                what = "registered" if forced in impls else "not registered"
                raise KeyError(
                    f"op {op!r} has no available {forced!r} backend on device {device_type!r} "
                    f"(forced by {source}; {forced!r} is {what} for it); registered: {sorted(impls)}, "
                    f"available here: {available(op, device_type)}")
            backend, reason = forced, f"forced by {source}"
    if backend is None:
        backend = next((b for b in PREFERENCE.get(device_type, ()) if b in impls and is_available(b, device_type)),
                       "reference")
        reason = "preferred"
        if backend not in impls:
            raise KeyError(f"op {op!r} has no reference implementation and nothing else available on "
                           f"{device_type!r}; registered: {sorted(impls)}")
    _CHOICES[(op, device_type)] = backend
    if (op, device_type, backend) not in _LOGGED:
        _LOGGED.add((op, device_type, backend))
        log.info("kernel %s on %s: %s (%s)", op, device_type, backend, reason)
    return backend


def get(op: str, device_type: str = "cpu") -> Callable:
    """The implementation of ``op`` to run on ``device_type`` (see the module docstring for the rules).

    While ``torch.compile`` traces, an op already chosen for the device returns that choice untouched (no
    logging, no state written: :func:`resolve_all` makes the choices before a model is compiled), so the
    lookup neither breaks the graph nor leaves guards that the next eager lookup would invalidate."""
    chosen = _CHOICES.get((op, device_type))
    if chosen is not None and _compiling():
        return eager_version((op, chosen), _IMPLS[op][chosen])
    backend = select(op, device_type)  # raises KeyError (naming what exists) before any lookup
    return _IMPLS[op][backend]


def _compiling() -> bool:
    import torch  # (torch is imported by every caller already; never at this module's import time)

    return torch.compiler.is_compiling()


def resolve_all(device_type: str) -> dict[str, str]:
    """Choose (and log) the backend of every registered op on ``device_type`` now, as :func:`get` would, and
    make the ``torch.compiler.disable`` wrapper of every function marked :func:`run_eagerly`; done before
    compiling a model, so that traced lookups find their choice and their wrapper made."""
    import torch

    for key, fn in _EAGER.items():
        if key not in _DISABLED:
            _DISABLED[key] = torch.compiler.disable(fn)
    return {op: select(op, device_type) for op in ops()}


def choices() -> dict[str, str]:
    """Backends picked so far, ``{"<op>/<device>": backend}`` (e.g. for ``mlflow.log_params``)."""
    return {f"{op}/{device}": backend for (op, device), backend in sorted(_CHOICES.items())}


def clear_choices() -> None:
    """Forget the recorded choices and the log-once memory (tests, or a new run in the same process)."""
    _CHOICES.clear()
    _LOGGED.clear()


# ------------------------------------------------------------------------------------------ triton helpers
_JITTED: dict[tuple[Callable, bool], Any] = {}


def triton_jit(fn: Callable, helpers: tuple[Callable, ...] = ()) -> Any:
    """``triton.jit(fn)`` on first use, for kernels written as plain module-level functions.

    Kernel modules must not import triton at import time, so they define their kernels as undecorated
    functions that use the module globals ``tl`` (and ``triton``); this binds those globals in the
    kernel's module, then JITs it (cached; re-JITted if ``TRITON_INTERPRET`` changed). ``helpers``: the plain
    functions the kernel calls; the compiler accepts only JIT functions there, so each is JITted too and bound
    under its name in the kernel's module (pass the plain functions, e.g. from a module-level tuple).
    """
    key = (fn, triton_interpret())
    if key not in _JITTED:
        import triton
        import triton.language as tl

        fn.__globals__["triton"], fn.__globals__["tl"] = triton, tl
        for helper in helpers:
            fn.__globals__[helper.__name__] = triton_jit(helper)
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]


def next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


TRITON_DTYPES = ("float16", "bfloat16", "float32")  # dtypes the Triton kernels take (fp64 -> reference)


def triton_dtypes(*ts: Any) -> bool:
    """Whether every given tensor (``None`` skipped) is in a dtype the Triton kernels take."""
    return all(t is None or str(t.dtype).removeprefix("torch.") in TRITON_DTYPES for t in ts)


_POISON = [os.environ.get("TREX_KERNEL_POISON", "") == "1"]


def empty_output(shape: Any, dtype: Any, device: Any) -> Any:
    """``torch.empty`` for kernel outputs; NaN-filled while poisoning is on (tests: unwritten elements show)."""
    import torch

    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if _POISON[0] and out.is_floating_point() else out


@contextlib.contextmanager
def poison_outputs(on: bool = True) -> Iterator[None]:
    """Fill kernel outputs with NaN before the kernels write them (also env ``TREX_KERNEL_POISON=1``)."""
    old, _POISON[0] = _POISON[0], on
    try:
        yield
    finally:
        _POISON[0] = old


def num_programs(device: Any) -> int:
    """A persistent-grid size for ``device``: 2 x SMs on CUDA, a fixed guess elsewhere (4 when interpreted)."""
    dtype = getattr(device, "type", str(device))
    if dtype == "cuda":
        import torch

        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    if dtype == "npu":
        return 48  # ~AI cores of an Ascend 910B; untested here
    return 4
