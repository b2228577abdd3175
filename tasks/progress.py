"""Rich progress bars for long stages, driven by the libraries' ``progress(label, done, total)`` callbacks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


@contextmanager
def stage_progress(stage: str) -> Iterator[Callable[[str, int, int], None]]:
    bars: dict[str, int] = {}
    with Progress(TextColumn(f"[bold cyan]{stage}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False) as progress:

        def update(label: str, done: int, total: int) -> None:
            if label not in bars:
                bars[label] = progress.add_task(label, total=total)
            progress.update(bars[label], completed=done, total=total)

        yield update
