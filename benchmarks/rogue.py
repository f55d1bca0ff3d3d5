"""Rogue benchmark: what a misbehaving peer costs a run, with the defaults a user gets, beside a clean run.

    python benchmarks/rogue.py [--json]

Each scenario runs a real local swarm on loopback (tiny model, 2 stages, 6 steps; the lowest-ID ones at
each ``--leader-steps``, by default 6 and 120), in one invocation:

* **clean**: 4 agents, nobody misbehaving;
* **non-member flood**: the same 4 agents, and a peer outside the run (``tests/agent/rogue_sender.py``: a
  real identity on the run's DHT, no peer record) that opens four streams into every agent announcing
  256 MiB and trickling a byte every two seconds, and sends each agent eight 1 MiB messages a second;
* **boasting swallower**: 4 honest agents and a fifth member (``tests/agent/rogue_member.py``) that claims
  9 PFLOP/s, 8000 GB and 900 Gbit/s links and, given a stage, takes tensors and answers nothing (tensor
  deadline 15 s, a clean 5-agent run beside it);
* **cooperative swallower**: the same, but a member that claims nothing special, takes tensors, answers
  nothing and then halts like an honest peer once another trainer did (``swallow_and_halt``): no single
  failure makes it a culprit, the blames of two epochs quarantine it (the same clean run beside it);
* **lowest-ID rogue**, five ways (``tests/agent/rogue_leader.py``): an open run that expects 4 agents, and
  an uninvited fifth with a valid identity that sorts lowest, so the election names it leader. It is
  ``silent`` (never plans), ``leaves_out`` (its first plan leaves two live honest agents out),
  ``idle_stage`` (an honest-looking plan in which it holds a stage, then it never computes),
  ``other_data`` (its peer record claims another dataset) or ``int4`` (its plans switch the fp32 run to
  int4). Beside a clean run of the 4 honest agents; every setting is the default ``p2ptrain swarm`` gives
  (leader grace, search budget, tensor deadline), none shrunk to fit.
* **corrupt sums** and **forged blame** (``tests/agent/corrupt_member.py``; docs/verification.md): 4 agents,
  one of them (a trainer, never the leader) scaling ×8 (``scale``) or negating (``negate``) the gradient shards
  it sums from step 2 on, or blaming an honest peer of its group with a doctored statement at step 2
  (``forge``); beside a clean run of the same 4 (tensor deadline 15 s);
* **corrupt pipeline** (the same rogues, the recompute check): 4 agents as the swarm test runs them (8
  micro-batches per replica, the ``megatron`` placement, so the rogue holds the stage whose messages it
  corrupts), one of them sending, from step 2 on, activations with noise (``act_noise``), activation
  gradients with noise (``grad_noise``), another token's activations in place of its compute's (``skip``),
  or noisy activations it commits to while it reveals the clean ones to its verifier (``clean_reveal``),
  or corrupting only the micro-batches it guesses are unchecked (``guess``); and a verifier that says its
  recomputes of step 2 failed, forwarding its group-mate's honest work as the evidence (``lie``: the forged
  recompute blame); beside a clean run of the same 4.

For the corrupt and forged ones also: whether the run is ``ok`` (every honest agent finished, the rogue and
nobody else quarantined), the steps rolled back (``rolled_back``: per re-plan, the furthest step an honest
member applied in the epochs it ends minus the step it restarts from; summed), the steps redone (``redone``:
the same with each refused step counted as reached, so the refused step's discarded work counts), the
re-plans' start steps, the steps an honest finder refused (the indices in its ``verify_failed`` events: index
2 is the third step, the one a restart from step 2 redoes), and whether every step's loss is the
single-process reference's (within 1e-4, relative; the redone step's loss counts).

Per run: the wall time from launch until every honest agent finished (for the lowest-ID rogues and the
corrupt and forged ones: until the last honest agent's ``done`` event, without the teardown after), beside its
clean run's (ratio, and the extra seconds), the plans published, the peers quarantined, and the honest
messages refused (goal: 0). For the corrupt and forged ones also the training time (``train s``, clean/attacked:
from the first plan to the last honest ``done``, without the start-up, whose seconds on a busy machine say
nothing of the rogue). ``--clean-each`` runs a clean run just before every attacked one.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "agent"))

from agent_helpers import bootstrap_maddrs, events, rolled_back, run_agents, sorted_identities  # noqa: E402
from test_untrusted_members import losses_of  # noqa: E402
from test_verified_work import PIPELINE_CASES  # noqa: E402

from p2ptrain.runtime.reference import train_reference  # noqa: E402
from p2ptrain.swarm.agent_launcher import SwarmConfig  # noqa: E402

ROGUES = ROOT / "tests" / "agent"
LEADER_MODES = ("silent", "leaves_out", "idle_stage", "other_data", "int4")
# the lowest-ID runs' lengths: 6 steps (a clean run of ~12 s here, mostly start-up) and 120 (~40 s, the
# length of the run issue 29 was measured on); a rogue's cost is a fixed number of seconds (the README)
LEADER_STEPS = (6, 120)


def _tally(workdir: Path, honest: set[str], leader_events: Path | None) -> dict:
    logs = "".join(p.read_text() for p in workdir.glob("agent-*.log"))
    refused = re.findall(r"refused a message from peer (\w+)", logs)
    plans = [e for e in events(leader_events) if e["event"] == "plan"] if leader_events else []
    quarantined = [e["peer"] for e in events(leader_events) if e["event"] == "quarantined"] if leader_events else []
    return {"plans": len(plans), "quarantined": len(quarantined),
            "honest_refused": sum(1 for p in refused if p in honest),
            "rogue_refused_lines": sum(1 for p in refused if p not in honest)}


def _swarm(flood: bool) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-rogue-"))
    run = "rogue-bench"
    started = time.monotonic()
    swarm = subprocess.Popen([sys.executable, "-m", "p2ptrain", "swarm", "--json", "--workdir", str(workdir), "--run",
                              run, "--scenario", "none", "--agents", "4", "--stages", "2", "--steps", "6"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rogue = None
    if flood:
        rogue = subprocess.Popen([sys.executable, str(ROGUES / "rogue_sender.py"), run, *bootstrap_maddrs(workdir)],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out, _ = swarm.communicate(timeout=1200)
    took = time.monotonic() - started
    if rogue is not None:
        rogue.send_signal(signal.SIGTERM)
        rogue.communicate(timeout=60)
    summary = json.loads(out) if out.strip() else {}
    honest = set(summary.get("peers", {}).values())
    leader = summary.get("leader")
    return {"ok": swarm.returncode == 0 and summary.get("finished", False), "seconds": took,
            "workdir": str(workdir), **_tally(workdir, honest, workdir / f"agent-{leader}.events.jsonl"
                                              if leader is not None else None)}


def _open_run(mode: str | None, steps: int) -> dict:
    """The 4 honest agents of an open run expecting 4 (``steps`` steps), and with ``mode`` a lowest-ID rogue
    leader as a fifth."""
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-rogue-"))
    sorted_identities(workdir, 5)
    agents_n = 5 if mode else 4
    config = SwarmConfig(agents=agents_n, stages=2, steps=steps, scenario=None, workdir=str(workdir),
                         run="rogue-bench-leader")
    if not mode:  # the same honest identities, without the rogue's
        for k in range(4):
            (workdir / f"agent-{k + 1}.id").rename(workdir / f"honest-{k}.id")
        for k in range(4):
            (workdir / f"honest-{k}.id").rename(workdir / f"agent-{k}.id")
    commands = {0: [sys.executable, str(ROGUES / "rogue_leader.py"), mode]} if mode else {}
    started = time.time()  # the events' clock: until the last honest agent was done, not the teardown after
    agents, codes, _ = run_agents(workdir, config, commands, {"membership": {"expect": 4}}, 900)
    honest = [a for a in agents if a.index not in commands]
    done = [e["time"] for a in honest for e in events(a.events.path) if e["event"] == "done"]
    took = (max(done) if len(done) == len(honest) else time.time()) - started
    leader_events = next((a.events.path for a in honest if any(e["event"] == "plan" for e in events(a.events.path))),
                         None)
    passed = [e for a in honest for e in events(a.events.path) if e["event"] == "passed_over"]
    return {"ok": all(c == 0 for c in codes.values()), "seconds": took, "workdir": str(workdir),
            "passed_over": len(passed), **_tally(workdir, {a.peer_id for a in honest}, leader_events)}


def _members(mode: str | None) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-rogue-"))
    sorted_identities(workdir, 5)
    config = SwarmConfig(agents=5, stages=2, steps=6, scenario=None, workdir=str(workdir), run="rogue-bench-member",
                         call_timeout_s=15.0)
    commands = {1: [sys.executable, str(ROGUES / "rogue_member.py"), mode]} if mode else {}
    started = time.monotonic()
    agents, codes, _ = run_agents(workdir, config, commands, {}, 900)
    took = time.monotonic() - started
    honest = {a.peer_id for a in agents if a.index not in commands}
    return {"ok": all(c == 0 for c in codes.values()), "seconds": took, "workdir": str(workdir),
            **_tally(workdir, honest, agents[0].events.path)}


def matches_reference(agents: list, train) -> bool:
    """Every step's loss (the latest epoch's, where a step was redone) is single-process training's, within 1e-4."""
    got, want = losses_of(agents), train_reference(train).losses
    if sorted(got) != list(range(1, len(want) + 1)):
        return False
    return all(abs(got[step] - loss) <= 1e-4 * abs(loss) for step, loss in enumerate(want, start=1))


def _corrupt(mode: str | None, pipeline: bool = False) -> dict:
    """4 agents, agent ``rogue`` (peer-ID order) running ``corrupt_member.py mode`` (none: the clean run);
    ``pipeline``: the recompute check's swarm shape (8 micro-batches, ``megatron``, the rogue the test's)."""
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-rogue-"))
    sorted_identities(workdir, 4)
    shape = {"micro_batches": 8, "strategy": "megatron"} if pipeline else {}
    config = SwarmConfig(agents=4, stages=2, steps=6, scenario=None, workdir=str(workdir), run="rogue-bench-corrupt",
                         call_timeout_s=15.0, **shape)
    rogue = PIPELINE_CASES[mode][0] if mode in PIPELINE_CASES else 1  # never the leader (agent 0)
    commands = {rogue: [sys.executable, str(ROGUES / "corrupt_member.py"), mode]} if mode else {}
    started = time.time()  # the events' clock: until the last honest agent was done, not the teardown after
    agents, codes, train = run_agents(workdir, config, commands, {}, 900)
    honest = [a for a in agents if a.index not in commands]
    log = [e for a in honest for e in events(a.events.path)]
    done = [e["time"] for e in log if e["event"] == "done"]
    finished = max(done) if len(done) == len(honest) else time.time()
    plans = [e for e in log if e["event"] == "plan"]
    quarantined = {e["peer"] for e in log if e["event"] == "quarantined"}
    culprits = {agents[rogue].peer_id} if mode else set()
    applied = [e for e in log if e["event"] == "step"]
    per_replan = rolled_back(plans, applied)
    # a refused step's work is redone too (its ``step`` is the step's index: reached, it would be index + 1);
    # the rogue's refusals count (the forger's false one halts its group's step as well)
    refusals = [e for a in agents for e in events(a.events.path) if e["event"] == "verify_failed"]
    redone = rolled_back(plans, applied + [{"epoch": e["epoch"], "step": e["step"] + 1} for e in refusals])
    refused = sorted({(e["epoch"], e["step"]) for e in log if e["event"] == "verify_failed"})
    return {"ok": all(c == 0 for c in codes.values()) and quarantined == culprits, "seconds": finished - started,
            "train_s": finished - min((p["time"] for p in plans), default=started), "workdir": str(workdir),
            "rolled_back": sum(per_replan), "rolled_back_per_replan": per_replan, "redone": sum(redone),
            "redone_per_replan": redone,
            "restarts": [p["start_step"] for p in sorted(plans, key=lambda p: p["epoch"])[1:]],
            "refused": [step for _, step in refused], "reference": matches_reference(honest, train),
            **_tally(workdir, {a.peer_id for a in honest}, agents[0].events.path)}


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--only", multiple=True, help="Run only the scenarios whose name contains this (repeatable).")
@click.option("--leader-steps", type=click.IntRange(1), multiple=True, default=LEADER_STEPS, show_default=True,
              help="Steps of the lowest-ID runs (repeatable: each length is a clean run and the five beside it).")
@click.option("--clean-each", is_flag=True,
              help="A clean run just before every attacked one, not one per kind (a shared machine's load drifts).")
def main(as_json: bool, only: tuple[str, ...], leader_steps: tuple[int, ...], clean_each: bool) -> None:
    rows = []
    cleans: dict = {}  # one clean run serves every scenario of its kind

    def clean(kind: str, run) -> dict:
        if kind not in cleans or clean_each:  # (``setdefault`` would run it every time)
            cleans[kind] = run(None)
        return cleans[kind]

    scenarios = [("non-member flood", lambda: _swarm(False), lambda: _swarm(True)),
                 ("boasting swallower", lambda: clean("members", _members), lambda: _members("swallow")),
                 ("cooperative swallower", lambda: clean("members", _members), lambda: _members("swallow_and_halt")),
                 *[(f"corrupt sums ({m})", lambda: clean("corrupt", _corrupt), lambda m=m: _corrupt(m))
                   for m in ("scale", "negate")],
                 ("forged blame", lambda: clean("corrupt", _corrupt), lambda: _corrupt("forge")),
                 ("forged recompute blame", lambda: clean("pipeline", lambda _: _corrupt(None, True)),
                  lambda: _corrupt("lie", True)),
                 *[(f"corrupt pipeline ({m})", lambda: clean("pipeline", lambda _: _corrupt(None, True)),
                    lambda m=m: _corrupt(m, True)) for m in PIPELINE_CASES]]
    for steps in leader_steps:
        for mode in LEADER_MODES:
            scenarios.append((f"lowest-ID {mode} {steps}", lambda n=steps: clean(f"open {n}", lambda _: _open_run(None, n)),
                              lambda m=mode, n=steps: _open_run(m, n)))
    for scenario, clean_run, attacked in scenarios:
        if only and not any(o in scenario for o in only):
            continue
        click.echo(f"running {scenario}: clean, then attacked ...", err=True)
        base, hit = clean_run(), attacked()
        rows.append({"scenario": scenario, "clean": base, "attacked": hit, "ratio": hit["seconds"] / base["seconds"],
                     "extra_s": hit["seconds"] - base["seconds"]})
    if as_json:
        click.echo(json.dumps(rows))
        return
    for line in table(rows):
        click.echo(line)


def table(rows: list[dict]) -> list[str]:
    """The rows (``--json``'s) as the table's lines."""
    lines = [f"{'scenario':<32} {'ok':<5} {'clean s':>8} {'attacked s':>10} {'extra s':>8} {'ratio':>6} {'plans':>5} "
             f"{'train s':>11} {'train ratio':>11} {'quarantined':>11} {'passed over':>11} {'rolled back':>11} "
             f"{'redone':>6} {'restarts':>8} {'refused':>7} {'reference':>9} {'honest refused':>14} "
             f"{'rogue refused (log lines)':>25}"]
    for r in rows:
        a, base = r["attacked"], r["clean"]
        listed = {k: ",".join(map(str, a[k])) or "-" if k in a else "-" for k in ("restarts", "refused")}
        reference = str(a["reference"] and base["reference"]) if "reference" in a else "-"
        train_s = f"{base['train_s']:.1f}/{a['train_s']:.1f}" if "train_s" in a else "-"
        train_ratio = f"{a['train_s'] / base['train_s']:.2f}x" if "train_s" in a else "-"
        lines.append(f"{r['scenario']:<32} {str(a['ok'] and base['ok']):<5} {base['seconds']:8.1f} {a['seconds']:10.1f} "
                     f"{r['extra_s']:8.1f} {r['ratio']:5.2f}x {a['plans']:>5} {train_s:>11} {train_ratio:>11} "
                     f"{a['quarantined']:>11} {a.get('passed_over', '-'):>11} {a.get('rolled_back', '-'):>11} "
                     f"{a.get('redone', '-'):>6} {listed['restarts']:>8} {listed['refused']:>7} {reference:>9} "
                     f"{a['honest_refused']:>14} {a['rogue_refused_lines']:>25}")
    return lines


if __name__ == "__main__":
    main()
