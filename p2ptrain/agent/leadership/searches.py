"""A plan's searches in an agent: remembered by their inputs, and a follower's run in one thread of lower priority.

    document = searched_plan(cluster, workload, stages, plan_config, search, time_budget_s=None, check=True)

A follower searches the plans it checks (``plan_maker.make_plan`` with ``check=True``): to time the leader's
search (``watching``) and to price the leader's plan against its own (``plan_check.cost_check``). Same inputs,
same search: the searches this process made lately are kept by their inputs (``KEPT_SEARCHES``), and the second
is the first's (sixteen agents on two cores: those two searches each were the first epoch's longest wait).

A follower's searches are the agent's least urgent work: its heartbeats, its DHT polls, the steps it trains,
and, where agents share a machine, the leader's own search come first. Beyond the exact solver's sizes
(``planning.exhaustive.MAX_DEVICES``: those cost milliseconds, and run in the caller's thread) they run in one
thread (``run``) whose nice value is raised by ``CHECK_NICE`` on Linux (per thread there; elsewhere it runs at the
agent's). Measured in a 32-agent local swarm on two cores, where 31 followers searched while their leader did:
at the agents' priority the leader's search of 32 devices ran into its 60 s budget and its grace ran out before
its plan was stored; with the followers' searches at nice 10 it took 53 s, and every follower accepted its plan
(``benchmarks/README.md``, "Links at scale"). Nice 19 starved a search 45× beside two busy processes, too slow on a
machine shared with other work. A search waits for the one before it; a search of the key of one in flight is
not run twice.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import hashlib
import logging
import os
import pickle
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from p2ptrain.planning import schedule
from p2ptrain.planning.baselines import RANDOM_SAMPLES
from p2ptrain.planning.exhaustive import MAX_DEVICES as EXACT_MAX_DEVICES
from p2ptrain.planning.plan import Infeasible

if TYPE_CHECKING:
    from p2ptrain.agent.config import PlanConfig
    from p2ptrain.planning import Cluster, Workload
    from p2ptrain.planning.search import SearchConfig

logger = logging.getLogger(__name__)

CHECK_NICE = 10  # the check thread's nice value above the agent's (CFS weight 110 against 1,024 at 0; 19 starved it 45x)
KEPT_SEARCHES = 4  # the searches remembered by their inputs

_searched: collections.OrderedDict[bytes, dict[str, Any]] = collections.OrderedDict()
_searched_lock = threading.Lock()
_last_parts: tuple[Any, dict[str, bytes]] | None = None  # our last check's inputs (``_parts``)

_lock = threading.Lock()
_queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_in_flight: dict[bytes, concurrent.futures.Future[Any]] = {}


def _lower_priority() -> None:
    """Raise the calling thread's nice value (Linux schedules threads on their own)."""
    if sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + CHECK_NICE))
    except OSError as e:  # a sandbox may refuse; the searches then run at the agent's priority
        logger.info("could not lower the check thread's priority: %s", e)


def _serve() -> None:
    """The check thread (a daemon: a search under way never holds up the agent's exit)."""
    _lower_priority()
    while True:
        search, future = _queue.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(search())
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
            future.set_exception(e)


def run(key: bytes | None, search: Callable[[], Any]) -> Any:
    """``search()``'s result, computed in the check thread (its exception raised here); with ``key``, a search of
    the same key already running or queued is waited for instead of run again."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():  # started on first use (and anew in a forked child)
            _thread = threading.Thread(target=_serve, name="p2ptrain-check", daemon=True)
            _thread.start()
        future = _in_flight.get(key) if key is not None else None
        if future is None:
            future = concurrent.futures.Future()
            if key is not None:  # before the search is queued: a done future calls back at once
                _in_flight[key] = future
                future.add_done_callback(lambda done: _forget(key, done))
            _queue.put((search, future))
    return future.result()


def _forget(key: bytes, done: concurrent.futures.Future[Any]) -> None:
    with _lock:
        if _in_flight.get(key) is done:
            del _in_flight[key]


def searched_plan(cluster: Cluster, workload: Workload, num_stages: int, config: PlanConfig, search: SearchConfig,
                  time_budget_s: float | None, check: bool = False) -> dict[str, Any]:
    """The scheduler's plan document for ``search`` under ``time_budget_s`` (None: bounded by evaluations only),
    remembered by its inputs (``_searched``); a follower's (``check``) in the check thread, without the random
    baseline (nothing checks it). ValueError where there is no plan."""
    key = _search_key(cluster, workload, num_stages, config, (search, check, time_budget_s))
    global _last_parts
    parts = _parts(cluster, workload, num_stages, config) if check else None
    with _searched_lock:
        found = _searched.get(key) if key is not None else None
        last, _last_parts = _last_parts, (parts or _last_parts)
    if found is not None:
        logger.info("plan of these %d devices in %d stages as searched before: %.5g s/iteration",
                    cluster.num_devices, num_stages, found["cost_s"])
        return copy.deepcopy(found)
    if parts is not None and last is not None and last[0] == parts[0]:  # the same devices as our last check, other inputs
        logger.info("searching these %d devices anew: their %s differ from our last search's", cluster.num_devices,
                    ", ".join(name for name in parts[1] if parts[1][name] != last[1].get(name)) or "inputs")

    def searched() -> Any:
        return schedule(cluster, workload, num_stages, seed=config.seed, objective=config.objective,
                        time_budget_s=time_budget_s, clock=time.perf_counter, config=search,
                        random_samples=0 if check else RANDOM_SAMPLES)
    # the exact solver's small runs (every CI swarm) cost milliseconds: they stay in the caller's thread
    plan = run(key, searched) if check and cluster.num_devices > EXACT_MAX_DEVICES else searched()
    if isinstance(plan, Infeasible):
        raise ValueError(f"no plan: {plan.reason}")
    document = plan.to_json()
    if key is not None:
        with _searched_lock:
            _searched[key] = copy.deepcopy(document)
            while len(_searched) > KEPT_SEARCHES:
                _searched.popitem(last=False)
    return document


def _parts(cluster: Cluster, workload: Workload, num_stages: int, config: PlanConfig) -> tuple[Any, dict[str, bytes]]:
    """The devices of a search, and a digest of each of its other inputs by name: which of them differ where a
    follower's check cannot reuse its search of when the plan fell due (logged, ``searched_plan``)."""
    named = {f"cluster.{f.name}": getattr(cluster, f.name) for f in dataclasses.fields(cluster) if f.name != "devices"}
    named.update({"devices": cluster.devices, "workload": workload, "stages": num_stages, "config": config})
    digests = {}
    for name, value in named.items():
        try:
            digests[name] = hashlib.blake2b(pickle.dumps(value, protocol=5), digest_size=8).digest()
        except Exception:  # noqa: BLE001 - an input that does not pickle is told apart from nothing
            digests[name] = b""
    return tuple(d.name for d in cluster.devices), digests


def _search_key(cluster: Cluster, workload: Workload, num_stages: int, config: PlanConfig,
                search: tuple[Any, ...]) -> bytes | None:
    try:
        return hashlib.blake2b(pickle.dumps((cluster, workload, num_stages, config, search), protocol=5)).digest()
    except Exception:  # noqa: BLE001 - an input that does not pickle is searched afresh, never a failure
        return None
