"""The top-level command group, whose commands load when they are invoked.

`det-local job list` imports typer, cli/main.py and cli/job.py, not the modules of the twenty
other command groups (experiment's tables, checkpoints, history...). Each entry of `main.py`'s
table names a loader returning a typer app (a group) or a function (a command); it is called
the first time its name is looked up (`get_command`), and the click object is built by typer
exactly as `add_typer(app, name=..., cls=DetGroup)` / `app.command(name)` would have built it
(through a one-entry typer app of the same settings), so the help, usage lines and parsing are
the same. `-h` lists commands in the table's order, loading them all (for their short help).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer

from det_local.cli.group import DetGroup


@dataclass(frozen=True)
class Lazy:
    """One top-level name: `load()` returns a typer app (a group) or a command function."""

    name: str
    load: Callable[[], Any]
    group: bool


class LazyGroup(DetGroup):
    """DetGroup whose commands are built from `TABLE` on first use, in its order."""

    TABLE: tuple[Lazy, ...] = ()

    def _lazy(self) -> dict[str, Lazy]:
        return {entry.name: entry for entry in self.TABLE}

    def list_commands(self, ctx: Any) -> list[str]:
        return [entry.name for entry in self.TABLE] + [
            n for n in super().list_commands(ctx) if n not in self._lazy()
        ]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        name = self._aliases().get(cmd_name, cmd_name)
        if name not in self.commands and name in self._lazy():
            self.commands[name] = build(self._lazy()[name])
        return super().get_command(ctx, cmd_name)

    def unknown(self, ctx: Any, name: str) -> str:
        self.load_all()  # the closest name is chosen among all commands, hidden ones excluded
        return super().unknown(ctx, name)

    def load_all(self) -> None:
        """Every command built (what walks the whole tree needs: completion, tests)."""
        for entry in self.TABLE:
            if entry.name not in self.commands:
                self.commands[entry.name] = build(entry)


def build(entry: Lazy) -> Any:
    """The click command typer builds for this entry as a subcommand of the top group."""
    holder = typer.Typer(cls=DetGroup, rich_markup_mode=None, add_completion=False)
    target = entry.load()
    if entry.group:
        holder.add_typer(target, name=entry.name, cls=DetGroup)
    else:
        holder.command(entry.name)(target)
    return typer.main.get_group(holder).commands[entry.name]
