"""Where curation work runs: spawned worker processes (default) or a Dask cluster.

An executor is ``run(fn, items) -> list`` preserving order; ``fn`` and the items must be picklable.
Spawned workers share no solver state with the caller (two HiGHS copies in one process can crash).
"""

from __future__ import annotations

from typing import Any, Callable

Executor = Callable[[Callable[[Any], Any], list], list]


def process_pool_map(workers: int, chunksize: int = 1) -> Executor:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    def run(fn, items):
        if not items:
            return []
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
            return list(pool.map(fn, items, chunksize=chunksize))

    return run


def dask_map(address: str) -> Executor:
    """Run on the Dask scheduler at ``address`` (``data.executor: dask``)."""
    from distributed import Client

    def run(fn, items):
        with Client(address) as client:
            return client.gather(client.map(fn, items, pure=False))

    return run
