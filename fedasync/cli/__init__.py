"""The ``fedasync`` command (typer + rich, like Flower's own CLI). One module per command group."""

from __future__ import annotations

import typer

import fedasync
from fedasync.cli import runs as _runs
from fedasync.cli import simulate as _simulate

app = typer.Typer(
    name="fedasync",
    help="Asynchronous federated learning on Flower.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fedasync {fedasync.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print fedasync's version and exit.",
                                 callback=_version, is_eager=True),
) -> None:
    """Asynchronous federated learning on Flower."""


app.command("simulate")(_simulate.simulate)
app.command("runs")(_runs.runs)

# command groups added by other modules register here
for _mod in ("privacy", "deploy", "ledger", "gossip", "new", "task"):
    try:
        _m = __import__(f"fedasync.cli.{_mod}", fromlist=["register"])
    except ModuleNotFoundError as e:
        if e.name != f"fedasync.cli.{_mod}":
            raise
        continue
    _m.register(app)
