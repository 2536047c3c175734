"""The rich console of the command-line tools (``mlx-fleet`` and its subcommands, the demo):
its width off a terminal, and the progress of a build.

Used by :mod:`mlx_fleet.cli` and by the modules it dispatches to (:mod:`mlx_fleet.demo`,
:mod:`mlx_fleet.nodecli`, :mod:`mlx_fleet.canarycli`), so none of them imports the CLI back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from rich.console import Console

__all__ = ["make_console", "progress_builder"]

T = TypeVar("T")


def make_console(*, stderr: bool = False) -> Console:
    """A rich console; when output is not a terminal (CI logs, pipes) it is 160 columns wide
    instead of rich's 80, so tables stay readable."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=160)


def progress_builder(console: Console, build: Callable[..., T]) -> T:
    """Run ``build(progress=...)`` showing compiled-package counts: a live rich bar on a
    terminal; elsewhere (CI logs, pipes) a plain line at every further 10 %."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not console.is_terminal:
        started: dict[str, float] = {}
        shown: dict[str, int] = {}

        def plain(label: str, done: int, total: int) -> None:
            started.setdefault(label, time.monotonic())
            tenth = 10 * done // max(total, 1)
            if shown.get(label) != tenth:
                shown[label] = tenth
                console.print(f"building {label}: {done}/{total} packages ({10 * tenth}%), "
                              f"{time.monotonic() - started[label]:.0f}s", highlight=False)

        return build(progress=plain)

    tasks: dict[str, int] = {}
    with Progress(TextColumn("[bold]building {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("packages"), TimeElapsedColumn(), console=console, transient=False) as bar:
        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done, total=total)

        return build(progress=progress)


def print_step(console: Console) -> Callable[[str, float], None]:
    """A ``step(what, seconds)`` callback (the devcluster's ``StepFn``) printing one ``✓`` line
    per finished set-up step with its wall-clock seconds."""
    def step(what: str, seconds: float) -> None:
        console.print(f"[green]✓[/] {what} ({seconds:.1f}s)", highlight=False)

    return step
