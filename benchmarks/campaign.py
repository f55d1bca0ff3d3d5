"""Rogue campaign: every rogue of ``tests/agent/`` in every placement, over seeds, each beside a clean run.

    python benchmarks/campaign.py [--seeds N] [--quick] [--only SUBSTR ...] [--resume] [--json] [--out FILE]

A cell is a rogue mode in a placement (``act_noise @ finder``). For each of its seeds the campaign generates
fresh identities (sorted by peer ID: agent-0 is the lowest, the leader the election names) and runs the
same agents twice on loopback (tiny model, 2 stages, 6 steps, the run's ``seed`` setting the seed's number):
clean (the rogue's slot an honest agent, or absent for a lowest-ID leader, as ``benchmarks/rogue.py`` does),
then attacked. Placements, by agent index (peer-ID order), with ``strategy = "megatron"`` (stage j's
replica group is agents j·R … j·R + R − 1, pipeline i is {i, R + i}) and a tensor deadline of 15 s:

* ``leader-finder``: 4 agents, rogue 1, in the leader's group of two: the leader is the finder;
* ``finder``: 4 agents, rogue 3, in stage 1's group: a non-leader honest peer (agent 2) finds it;
* ``test``: the rogue of ``PIPELINE_CASES`` (tests/agent/test_verified_work.py);
* ``leader-neighbour``: 4 agents, rogue 2, the leader's pipeline neighbour (stage 1 of pipeline 0);
* ``warm-copy holder``: 4 agents, rogue 2, replica 0 of stage 1: the source of the stage's warm copy, which
  an honest peer keeps (agent 1: ``choose_backups`` skips the stage's group and the source's neighbours);
  the row records the first plan's holders;
* ``spare``: 5 agents, rogue 1 (3 for a mode that corrupts only stage 1's messages), agent 4 an honest spare;
* ``colluding``: 6 agents, 2 stages × 3 replicas, two rogues of the mode sharing a group with an honest peer
  (1 and 2, or 4 and 5 for a stage-1 mode); the global batch grows to 3 replicas' worth of micro-batches.

The pipeline modes (``act_noise`` … ``guess``) and ``lie`` run the recompute check's shape (8 micro-batches;
``guess`` 16 and a batch of 32, as the test); a pipeline mode runs only where the rogue's stage sends the
messages it corrupts (stage 0 activations, stage 1 activation gradients), and placements that land on the
same agents are one cell (``leader-finder+test``). Lowest-ID leaders (``rogue_leader.py``): an open run of 4
honest agents expecting 4, the rogue a fifth sorting lowest, defaults otherwise (``rogue.py``'s
``_open_run``); ``silent_replan`` the same with 30 steps and the first honest non-leader trainer to reach step 2
SIGKILLed in both runs (the killed agent counts as neither finished nor quarantined). Swallowers
(``rogue_member.py``): 5 agents, rogue 1, the default strategy.

Per cell over its seeds: runs; finished (every honest agent exited 0); reference (every step's loss the
single-process one within 1e-4, relative); rogue quarantined (every rogue named by a ``quarantined`` event;
not required of a lowest-ID leader, which is passed over); honest passed over / quarantined (runs with a
``passed_over`` / ``quarantined`` event naming an honest peer); stranded (honest agents that did not exit 0
within the deadline); plans; the clean run's seconds and the extra seconds (attacked minus clean, each from
launch until the last honest ``done`` event: mean/max); the limit max(10 s, half the clean run); a cell
passes when every seed's attacked run passes all of these and its extra seconds are within its limit.

Each seed's row is a JSON line appended to ``--out`` as soon as it is measured; ``--resume`` skips the cells'
seeds already there (the table then includes them). ``leader-finder`` runs max(N, 10) seeds unless ``--quick``.
Every run's work dir (``/tmp/p2ptrain-campaign-*``, in the row) is kept; a passing seed's without the agents'
saved states (``agent-K.state``, most of its 20 MB).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "agent"))

from agent_helpers import events, run_agents, sorted_identities  # noqa: E402
from corrupt_member import PIPELINE_MODES  # noqa: E402
from rogue import LEADER_MODES, ROGUES, matches_reference  # noqa: E402
from test_verified_work import PIPELINE_CASES  # noqa: E402

from p2ptrain.net.transport.messages import MessageKind  # noqa: E402
from p2ptrain.swarm.agent_launcher import SwarmConfig  # noqa: E402

STEPS = 6
STAGES = 2
CALL_TIMEOUT_S = 15.0  # the tensor deadline rogue.py gives its member rogues
DEADLINE_S = 600.0  # every run: until each honest agent exited, then the rest are stopped
LEADER_FINDER_SEEDS = 10
LIMIT_FLOOR_S = 10.0
OUT = ROOT / "benchmarks" / "results" / "campaign.jsonl"
SUM_MODES = ("scale", "negate", "forge", "after_commit", "accuse_back", "censor")
SWALLOW_MODES = ("swallow", "swallow_and_halt", "claim_and_swallow")
SCRIPTS = {"member": "corrupt_member.py", "leader": "rogue_leader.py", "swallower": "rogue_member.py"}


@dataclasses.dataclass(frozen=True)
class Cell:
    mode: str
    placement: str
    family: str  # "member" (corrupt_member.py), "leader" (rogue_leader.py) or "swallower" (rogue_member.py)
    agents: int  # with the rogues
    rogues: tuple[int, ...]  # agent indices in peer-ID order
    settings: tuple[tuple[str, object], ...] = ()  # SwarmConfig fields besides the pinned ones
    kill_at: int = 0  # > 0: the first honest non-leader trainer to reach this step is killed (both runs)
    steps: int = STEPS

    @property
    def name(self) -> str:
        return f"{self.mode} @ {self.placement}"

    def seeds(self, seeds: int, quick: bool) -> int:
        return max(seeds, LEADER_FINDER_SEEDS) if "leader-finder" in self.placement and not quick else seeds


def _shape(mode: str, replicas: int) -> dict:
    """The swarm settings of a member rogue: megatron; the recompute check's micro-batches for the pipeline
    modes and ``lie``; with 3 replicas the global batch that keeps the 2-replica run's rows per micro-batch."""
    if mode == "guess":
        shape = {"micro_batches": 16, "batch_size": 32}
    elif mode in PIPELINE_MODES or mode == "lie":
        shape = {"micro_batches": 8}
    else:
        shape = {}
    if replicas == 3:
        micro_batches = shape.get("micro_batches", SwarmConfig.micro_batches)
        rows = shape.get("batch_size", 16) // (2 * micro_batches)
        shape["batch_size"] = 3 * micro_batches * rows
    return {"strategy": "megatron", **shape}


def _sends_corrupt(mode: str, stage: int) -> bool:
    """Whether a rogue of ``mode`` on ``stage`` (of 2) corrupts anything: stage 0 sends activations only, the
    last stage activation gradients only; the other modes corrupt sums or blames, anywhere."""
    if mode not in PIPELINE_MODES:
        return True
    sent = MessageKind.ACTIVATION if stage == 0 else MessageKind.ACTIVATION_GRAD
    return sent in PIPELINE_MODES[mode]


def member_cells(mode: str) -> list[Cell]:
    """A corrupting member's cells: each placement where it corrupts something, placements on the same agents
    merged into one cell."""
    stage0 = _sends_corrupt(mode, 0)
    placements = [("leader-finder", 4, (1,)), ("finder", 4, (3,))]
    if mode in PIPELINE_CASES:
        placements.append(("test", 4, (PIPELINE_CASES[mode][0],)))
    if mode in PIPELINE_MODES:
        placements.append(("leader-neighbour", 4, (2,)))
    placements += [("warm-copy holder", 4, (2,)), ("spare", 5, (1,) if stage0 else (3,)),
                   ("colluding", 6, (1, 2) if stage0 else (4, 5))]
    merged: dict[tuple, list[str]] = {}
    for name, agents, rogues in placements:
        replicas = 3 if agents == 6 else 2
        if all(_sends_corrupt(mode, r // replicas) for r in rogues):
            merged.setdefault((agents, rogues), []).append(name)
    return [Cell(mode, "+".join(names), "member", agents, rogues,
                 tuple(_shape(mode, 3 if agents == 6 else 2).items()))
            for (agents, rogues), names in merged.items()]


def all_cells() -> list[Cell]:
    modes = (*SUM_MODES, "lie", *PIPELINE_MODES)
    return [*(c for mode in modes for c in member_cells(mode)),
            *(Cell(mode, "lowest-ID leader", "leader", 5, (0,)) for mode in LEADER_MODES),
            # silent at the re-plan a killed trainer makes (30 steps: the kill lands while the run trains)
            Cell("silent_replan", "lowest-ID leader, a trainer killed at step 2", "leader", 5, (0,), kill_at=2,
                 steps=30),
            *(Cell(mode, "member", "swallower", 5, (1,)) for mode in SWALLOW_MODES)]


def run_once(cell: Cell, seed: int, keys: Path, attacked: bool) -> dict:
    """One run of ``cell``'s agents (identities from ``keys``): with its rogues, or clean (a lowest-ID leader's
    slot absent, a member rogue's an honest agent)."""
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-campaign-"))
    absent = cell.family == "leader" and not attacked
    slots = [k for k in range(cell.agents) if not (absent and k in cell.rogues)]
    for k, slot in enumerate(slots):
        shutil.copy(keys / f"agent-{slot}.id", workdir / f"agent-{k}.id")
        (workdir / f"agent-{k}.id").chmod(0o600)
    settings = dict(cell.settings)
    if cell.family != "leader":  # the open run keeps every default, as rogue.py's ``_open_run``
        settings["call_timeout_s"] = CALL_TIMEOUT_S
    config = SwarmConfig(agents=len(slots), stages=STAGES, steps=cell.steps, scenario=None, workdir=str(workdir),
                         run="campaign", seed=seed, **settings)
    script = [sys.executable, str(ROGUES / SCRIPTS[cell.family]), cell.mode]
    commands = {r: script for r in cell.rogues} if attacked else {}
    overrides = {"membership": {"expect": 4}} if cell.family == "leader" else {}
    killed: list[int] = []
    started = time.time()  # the events' clock: until the last honest agent was done, not the teardown after
    try:
        with contextlib.redirect_stdout(sys.stderr):  # run_agents prints failed agents' log tails
            agents, codes, train = run_agents(workdir, config, commands, overrides, DEADLINE_S,
                                              on_start=_killer(cell.kill_at, set(commands), killed)
                                              if cell.kill_at else None)
    except Exception as error:  # a failed start or a logging error: the row says so, the campaign goes on
        return {"workdir": str(workdir), "error": f"{type(error).__name__}: {error}", "finished": False,
                "reference": False, "rogue_quarantined": False, "honest_passed_over": [], "honest_quarantined": [],
                "stranded": len(slots) - len(commands), "plans": 0, "seconds": None}
    codes = {name: code for name, code in codes.items() if int(name.rsplit("-", 1)[1]) not in killed}
    return {"workdir": str(workdir), "killed": killed, **measure(agents, codes, train, set(commands), started, killed)}


def _killer(step: int, rogues: set[int], killed: list[int]):
    """An ``on_start`` for ``run_agents``: SIGKILL (the agent, its DHT process and its daemon) the first honest
    agent other than agent 0 whose events say it trained ``step`` steps; its index goes into ``killed``."""

    def on_start(group, agents) -> None:
        def watch() -> None:
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline and not killed:
                for a in agents[1:]:
                    if a.index not in rogues and any(e["event"] == "step" and e["step"] >= step
                                                     for e in events(a.events.path)):
                        killed.append(a.index)
                        group.signal(a.name, signal.SIGKILL)
                        return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()

    return on_start


def measure(agents: list, codes: dict, train, rogues: set[int], started: float, killed: list[int] = ()) -> dict:
    """What a run's honest agents' events say (agents named by index; the ``killed`` one's done is not waited for)."""
    index = {a.peer_id: a.index for a in agents}
    every = [a for a in agents if a.index not in rogues]  # the killed one's steps count for the losses
    honest = [a for a in every if a.index not in killed]
    logs = {a.index: events(a.events.path) for a in honest}
    log = [e for mine in logs.values() for e in mine]
    done = {k: max(e["time"] for e in mine if e["event"] == "done") for k, mine in logs.items()
            if any(e["event"] == "done" for e in mine)}
    finished_at = max(done.values()) if len(done) == len(honest) else time.time()
    plans = {e["epoch"]: e for e in log if e["event"] == "plan"}
    quarantined = sorted({index.get(e["peer"], e["peer"]) for e in log if e["event"] == "quarantined"}, key=str)
    passed = sorted({index.get(e["peer"], e["peer"]) for e in log if e["event"] == "passed_over"}, key=str)
    return {"finished": len(codes) == len(honest) and all(c == 0 for c in codes.values()),
            "codes": codes, "stranded": sum(1 for c in codes.values() if c != 0),
            "seconds": finished_at - started, "plans": len(plans), "reference": matches_reference(every, train),
            "rogue_quarantined": bool(rogues) and rogues <= set(quarantined), "quarantined": quarantined,
            "passed_over": passed, "honest_quarantined": [k for k in quarantined if k not in rogues and k not in killed],
            "honest_passed_over": [k for k in passed if k not in rogues],  # the killed one is a fault we made
            "first_plan": _layout(plans[min(plans)], index) if plans else None}


def _layout(event: dict, index: dict) -> dict:
    """The first plan by agent index: each stage's replica group, the spares, each stage's warm-copy keeper."""
    devices, plan = event["devices"], event["plan"]
    groups = [[index.get(devices[row[j]], devices[row[j]]) for row in plan["pipelines"]] for j in range(plan["stages"])]
    keepers = (plan.get("warm_copies") or {}).get("peers") or []
    return {"stages": groups, "spares": [index.get(p, p) for p in event["spares"]],
            "warm_copies": [index.get(p, p) if p is not None else None for p in keepers]}


def run_seed(cell: Cell, seed: int) -> dict:
    """One seed of ``cell``: fresh identities, the clean run, then the attacked one; the row."""
    keys = Path(tempfile.mkdtemp(prefix="p2ptrain-campaign-keys-"))
    try:
        sorted_identities(keys, cell.agents)
        clean = run_once(cell, seed, keys, attacked=False)
        attacked = run_once(cell, seed, keys, attacked=True)
    finally:
        shutil.rmtree(keys, ignore_errors=True)
    timed = clean["seconds"] is not None and attacked["seconds"] is not None
    return {"cell": cell.name, "mode": cell.mode, "placement": cell.placement, "family": cell.family,
            "agents": cell.agents, "rogues": list(cell.rogues), "settings": dict(cell.settings), "seed": seed,
            "clean": clean, "attacked": attacked,
            "extra_s": attacked["seconds"] - clean["seconds"] if timed else None,
            "limit_s": max(LIMIT_FLOOR_S, clean["seconds"] / 2) if clean["seconds"] is not None else LIMIT_FLOOR_S}


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _honest_quarantined(run: dict) -> list:
    """The honest agents a run quarantined, less the one the campaign killed (a dead peer is a culprit)."""
    return [k for k in run["honest_quarantined"] if k not in run.get("killed", ())]


def failures(row: dict) -> list[str]:
    """Why one seed fails its cell (empty: it passes)."""
    a, why = row["attacked"], []
    checks = [(not row["clean"]["finished"], "clean unfinished"), (not a["finished"], "unfinished"),
              (not a["reference"], "reference"), (row["family"] != "leader" and not a["rogue_quarantined"],
              "rogue free"), (bool(a["honest_passed_over"]), "honest passed over"),
              (bool(_honest_quarantined(a)), "honest quarantined"), (a["stranded"] > 0, "stranded"),
              (row["extra_s"] is None or row["extra_s"] > row["limit_s"], "over limit")]
    why += [what for failed, what in checks if failed]
    return why


def summarise(rows: list[dict]) -> dict:
    """One cell's seeds as its table row."""
    runs = len(rows)
    attacked = [r["attacked"] for r in rows]
    extras = [r["extra_s"] for r in rows if r["extra_s"] is not None]
    cleans = [r["clean"]["seconds"] for r in rows if r["clean"]["seconds"] is not None]
    why = sorted({w for r in rows for w in failures(r)})
    return {"cell": rows[0]["cell"], "runs": runs, "finished": sum(a["finished"] for a in attacked),
            "reference": sum(a["reference"] for a in attacked),
            "rogue_quarantined": sum(a["rogue_quarantined"] for a in attacked),
            "honest_passed_over": sum(bool(a["honest_passed_over"]) for a in attacked),
            "honest_quarantined": sum(bool(_honest_quarantined(a)) for a in attacked),
            "stranded": sum(a["stranded"] for a in attacked), "plans": sorted({a["plans"] for a in attacked}),
            "clean_s": statistics.mean(cleans) if cleans else None,
            "extra_mean_s": statistics.mean(extras) if extras else None, "extra_max_s": max(extras, default=None),
            "limit_s": max(LIMIT_FLOOR_S, statistics.mean(cleans) / 2) if cleans else LIMIT_FLOOR_S,
            "passed": not why, "why": why}


def table(summaries: list[dict]) -> list[str]:
    """The cells' summaries as the table's lines."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [f"{'cell':<54} {'runs':>4} {'finished':>8} {'reference':>9} {'rogue q':>7} {'honest p/o':>10} "
             f"{'honest q':>8} {'stranded':>8} {'plans':>5} {'clean s':>7} {'extra s mean/max':>16} "
             f"{'limit s':>7}  result"]
    for s in summaries:
        runs = s["runs"]
        plans = "-".join(map(str, (s["plans"][0], s["plans"][-1]) if len(s["plans"]) > 1 else s["plans"]))
        extra = f"{seconds(s['extra_mean_s'])}/{seconds(s['extra_max_s'])}"
        result = "pass" if s["passed"] else "FAIL (" + ", ".join(s["why"]) + ")"
        lines.append(f"{s['cell']:<54} {runs:>4} {s['finished']:>4}/{runs:<3} {s['reference']:>5}/{runs:<3} "
                     f"{s['rogue_quarantined']:>3}/{runs:<3} {s['honest_passed_over']:>6}/{runs:<3} "
                     f"{s['honest_quarantined']:>4}/{runs:<3} {s['stranded']:>8} {plans:>5} "
                     f"{seconds(s['clean_s']):>7} {extra:>16} {s['limit_s']:>7.1f}  {result}")
    return lines


@click.command()
@click.option("--seeds", type=click.IntRange(1), default=3, show_default=True, help="Seeds per cell.")
@click.option("--quick", is_flag=True, help=f"leader-finder runs --seeds seeds too (not at least {LEADER_FINDER_SEEDS}).")
@click.option("--only", multiple=True, help="Run only the cells whose name contains this (repeatable).")
@click.option("--resume", is_flag=True, help="Skip the cells' seeds already in --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the cells' summaries as JSON, not a table.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=OUT, show_default=True,
              help="Each seed's row is appended here as a JSON line once measured.")
@click.option("--list", "list_only", is_flag=True, help="Print the selected cells and their agents; run nothing.")
def main(seeds: int, quick: bool, only: tuple[str, ...], resume: bool, as_json: bool, out: Path,
         list_only: bool) -> None:
    cells = [c for c in all_cells() if not only or any(o in c.name for o in only)]
    if list_only:
        for c in cells:
            click.echo(f"{c.name:<54} {c.seeds(seeds, quick):>2} seeds  {c.agents} agents, rogues {list(c.rogues)}, "
                       f"{dict(c.settings)}")
        return
    # SIGTERM unwinds like Ctrl-C: the running swarm's process group stops its agents, their DHT processes and
    # daemons (without this they outlived the campaign); the seed in flight is not written, --resume redoes it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = {(r["cell"], r["seed"]): r for r in read_rows(out)} if resume else {}
    todo = [(c, s) for c in cells for s in range(c.seeds(seeds, quick)) if (c.name, s) not in rows]
    for n, (cell, seed) in enumerate(todo, start=1):
        click.echo(f"[{n}/{len(todo)}] {cell.name} seed {seed}: clean, then attacked ...", err=True)
        began = time.monotonic()
        row = run_seed(cell, seed)
        if not failures(row):  # a passing seed keeps its logs and events, not its agents' saved states
            for run in (row["clean"], row["attacked"]):
                for state in Path(run["workdir"]).glob("agent-*.state"):
                    shutil.rmtree(state, ignore_errors=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        rows[(cell.name, seed)] = row
        click.echo(f"[{n}/{len(todo)}] {cell.name} seed {seed}: clean {row['clean']['seconds'] or 0:.1f} s, "
                   f"attacked {row['attacked']['seconds'] or 0:.1f} s ({time.monotonic() - began:.0f} s in all)"
                   f"{'' if not failures(row) else ': ' + ', '.join(failures(row))}", err=True)
    summaries = []
    for cell in cells:
        mine = [rows[(cell.name, s)] for s in range(cell.seeds(seeds, quick)) if (cell.name, s) in rows]
        if mine:
            summaries.append(summarise(mine))
    if as_json:
        click.echo(json.dumps(summaries))
        return
    for line in table(summaries):
        click.echo(line)


if __name__ == "__main__":
    main()
