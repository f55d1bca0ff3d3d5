"""The ``p2ptrain`` command line.

Each subcommand lives in its own module ``p2ptrain/cli/<name>.py`` exposing ``command`` (a click command);
modules are imported only when their command runs, so ``p2ptrain plan`` never imports torch or hivemind.
Commands only parse flags, build a config and call one library function: ``plan``, ``data``, ``train``,
``bootstrap``, ``agent``, ``token``, ``swarm``, ``export``, ``generate``, ``monitor`` and ``bench``, each the
command of its name; ``config_options`` (the flags of ``train``, ``swarm`` and ``agent``, made from the config
keys they set: one ``OptionTable`` per command), ``optimizer_options`` (the optimizer and synchronisation flags
those three share) and ``stage_count`` (the ``--stages S|auto`` type) are shared parts; ``doc_tables`` renders
the three commands' option tables into docs/design.md (``python -m p2ptrain.cli.doc_tables --write``).

Bad user input (a ``ValueError`` from the library, or a click usage error) ends with one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from p2ptrain import __version__

_COMMANDS = {
    "plan": "Plan a cluster: assign pipeline stages and data shards to devices.",
    "data": "Prepare tokenized datasets (memory-mapped token shards) and inspect them.",
    "train": "Train locally: one process, or stages x replicas worker processes on loopback.",
    "bootstrap": "Run a DHT-only bootstrap peer and print its multiaddrs.",
    "agent": "Join a run, profile, elect a leader, plan and train.",
    "token": "Closed runs: make a join token with the organiser's key, or print the organiser's ID.",
    "swarm": "Start a bootstrap and N agents on this machine (the demo, test and benchmark rig).",
    "export": "Export a checkpoint as a Hugging Face GPT-2 model (safetensors + config.json).",
    "generate": "Sample text from a checkpoint.",
    "monitor": "Serve a live web page, a JSON API and Prometheus metrics of a run.",
    "bench": "Benchmarks: planner, runtime, end-to-end.",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        return importlib.import_module(f"p2ptrain.cli.{name}").command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, help_ in _COMMANDS.items()])

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ValueError as e:  # bad input from the library: one line, exit 2
            click.echo(f"Error: {e}", err=True)
            ctx.exit(2)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="p2ptrain")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors.")
def main(verbose: int, quiet: bool) -> None:
    """p2ptrain: train foundation models on GPUs scattered across the internet."""
    configure_logging(verbose, quiet)


def configure_logging(verbose: int = 0, quiet: bool = False) -> None:
    """Logging is configured here, in the entry point, never by the library."""
    level = logging.WARNING if quiet else logging.DEBUG if verbose >= 2 else logging.INFO
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    if verbose < 2:
        for noisy in ("hivemind", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


if __name__ == "__main__":  # pragma: no cover
    main()
