"""``p2ptrain bench NAME``: the benchmarks. Each lives in ``p2ptrain/bench/<name>.py`` and exposes a click
command named ``command``; it is imported only when it runs (the planner benchmark never loads torch).
``p2ptrain/bench/__init__.py`` belongs to all benchmarks; this group only looks up ``p2ptrain.bench.<name>``.
To add one, write the module and add its name and one-line help to ``BENCHMARKS``.
"""

from __future__ import annotations

import importlib

import click

BENCHMARKS = {
    "planner": "The scheduler on the paper's five networks and at 1024 devices, against Megatron, random and GCMA; "
               "then on the same networks as measured (perturbed links), beside GCMA run live.",
    "links": "Links measured in O(k) per peer: the planner on estimated links against the planner on the full "
             "matrix, on the paper's five networks and homes (perturbed) at 64 and 256 devices.",
    "control_plane": "The control plane's cost per peer: each agent's DHT and control traffic a minute, measured in a "
                     "local swarm and modelled at 64, 256 and 1,000 peers.",
    "runtime": "Training step time of the pipeline + data-parallel runtime.",
    "e2e": "End to end: a local swarm on an emulated network; scheduled, Megatron's and a random plan, measured "
           "beside the simulated objective's predictions.",
    "decentralisation": "The cost of decentralisation at the paper's scale (GPT-3 XL, 64 V100s): world-wide over "
                        "data-center step time per runtime setting; with --networks, homes behind their access links, "
                        "the stage counts that fit memory and DiLoCo; predicted by the simulated objective.",
}


class _LazyBenchGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(BENCHMARKS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in BENCHMARKS:
            return None
        try:
            module = importlib.import_module(f"p2ptrain.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"p2ptrain.bench.{name}":
                raise
            return _not_yet(name)
        found = getattr(module, "command", None)  # a module may exist before its command does
        return found if isinstance(found, click.Command) else _not_yet(name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Benchmarks"):
            formatter.write_dl(list(BENCHMARKS.items()))


def _not_yet(name: str) -> click.Command:
    @click.command(name=name, help=BENCHMARKS[name])
    def stub() -> None:
        raise click.ClickException(
            f"benchmark '{name}' has no command yet (p2ptrain/bench/{name}.py needs a click command named "
            f"'command'); see benchmarks/ for its script"
        )

    return stub


@click.group(name="bench", cls=_LazyBenchGroup)
def command() -> None:
    """Benchmarks: speed and quality, printed side by side as ratios (never asserted)."""
