"""The ``trex`` command line: the top layer. It parses the configuration once and calls flows and libraries."""

import os
import sys


def start_with_allocator() -> None:
    """Re-execute this process once with the CPU allocator of ``TREX_CPU_ALLOCATOR`` preloaded (tcmalloc where
    the machine has it: ``trainer/allocator.py``), before anything heavy is imported; exit 2 on an impossible
    explicit choice. Entry points only (the console script, ``python -m trex``), never on a library import."""
    from trainer.allocator import AllocatorError, reexec_with_allocator

    common = sys.modules.get("trex.cli.common")  # imported already (python -m trex): the OpenMP wait policy it
    own = ("OMP_WAIT_POLICY",) if common is not None and common.USER_OMP_WAIT_POLICY is None else ()  # chose
    try:
        reexec_with_allocator(drop=own)
    except AllocatorError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


if os.path.basename(sys.argv[0]) == "trex":  # the console script (its wrapper imports this package first)
    start_with_allocator()

from trex.cli.main import app, main  # noqa: E402

__all__ = ["app", "main", "start_with_allocator"]
