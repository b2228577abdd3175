"""Kernel registry: one implementation per (op, backend); the caller's device picks the backend.

Backends are tried in order of preference for a device type: ``torch_npu`` and ``triton`` on
accelerators, and always the ``reference`` torch implementation last. A backend whose import or
availability check fails is skipped, so CPU runs use the reference code path.
"""

from __future__ import annotations

import os
from typing import Callable

_IMPLS: dict[str, dict[str, Callable]] = {}
_AVAILABLE: dict[str, Callable[[], bool]] = {"reference": lambda: True}
PREFERENCE = {
    "npu": ("torch_npu", "triton", "reference"),
    "cuda": ("triton", "reference"),
    "cpu": ("reference",),
}


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        _IMPLS.setdefault(op, {})[backend] = fn
        return fn

    return deco


def register_backend(backend: str, available: Callable[[], bool]) -> None:
    _AVAILABLE[backend] = available


def get(op: str, device_type: str = "cpu") -> Callable:
    """The preferred available implementation of ``op`` for ``device_type``.

    ``TREX_KERNEL_BACKEND=reference`` (or another backend name) forces one backend everywhere.
    """
    impls = _IMPLS.get(op)
    if not impls:
        raise KeyError(f"no kernel registered for op {op!r}; known: {sorted(_IMPLS)}")
    forced = os.environ.get("TREX_KERNEL_BACKEND")
    order = (forced,) if forced else PREFERENCE.get(device_type, ("reference",))
    for backend in order:
        if backend in impls and _AVAILABLE.get(backend, lambda: False)():
            return impls[backend]
    if forced:
        raise KeyError(f"op {op!r} has no available {forced!r} backend (have {sorted(impls)})")
    return impls["reference"]


def backends(op: str) -> list[str]:
    return sorted(_IMPLS.get(op, {}))
