"""The executor's schedules, buckets and wire formats, with S × D executors in threads of this process over
an in-memory link (the real transport is in test_distributed). Measures activation memory."""

import dataclasses
import queue
import threading
from concurrent.futures import Future

import pytest
import torch

from p2ptrain.model.optim import OptimizerConfig, build_optimizer
from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.model.stage import build_stage
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.executor import StageExecutor
from p2ptrain.runtime.reference import build_data, train_reference
from p2ptrain.runtime.topology import Topology

DEADLINE_S = 60.0


class MemoryLink:
    """A StepLink over queues shared by every thread; receives wait under a deadline."""

    def __init__(self, boxes, lock, me, steps=None):
        self.boxes, self.lock, self.me = boxes, lock, me
        self.steps = steps if steps is not None else {}  # step -> that step's boxes (``for_step``)

    def for_step(self, step):
        with self.lock:
            boxes = self.steps.setdefault(step, {})
        return type(self)(boxes, self.lock, self.me, self.steps)

    def _box(self, src, dst, kind, micro_batch, part):
        with self.lock:
            return self.boxes.setdefault((src, dst, kind, micro_batch, part), queue.Queue())

    def send(self, peer, kind, micro_batch, part, tensor):
        self._box(self.me, peer, kind, micro_batch, part).put(tensor.clone())
        done = Future()
        done.set_result(None)
        return done

    def recv(self, peer, kind, micro_batch, part, shape, dtype):
        t = self._box(peer, self.me, kind, micro_batch, part).get(timeout=DEADLINE_S)
        assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (kind, t.shape, shape, t.dtype, dtype)
        return t


class DelayedLink(MemoryLink):
    """A MemoryLink whose messages arrive ``DELAY_S`` after they are sent; a send's future is done then."""

    DELAY_S = 0.05

    def send(self, peer, kind, micro_batch, part, tensor):
        done, box, copy = Future(), self._box(self.me, peer, kind, micro_batch, part), tensor.clone()

        def deliver():
            box.put(copy)
            done.set_result(None)

        timer = threading.Timer(self.DELAY_S, deliver)
        timer.daemon = True
        timer.start()
        return done


class SlowLink(DelayedLink):
    """Messages take 0.2 s: long beside the skew between threads on a busy machine (their waits are measured)."""

    DELAY_S = 0.2


def train_in_threads(cfg: TrainConfig, link=MemoryLink):
    """Per step: the last stage's loss, every executor's parameters, and each step's outcomes by role."""
    rows = [[f"p{s}-{r}" for s in range(cfg.stages)] for r in range(cfg.replicas)]
    topology = Topology.from_rows(rows)
    data = build_data(cfg)
    executors = {}
    for peer in topology.peers:
        role = topology.role_of(peer)
        module = build_stage(cfg.shape, role.stage, cfg.stages, cfg.seed)
        executors[peer] = StageExecutor(module, build_optimizer(module, cfg.optimizer), data, cfg.micro_batches,
                                        cfg.shape.boundary_width, wire=cfg.wire, schedule=cfg.schedule,
                                        overlap=cfg.overlap, bucket_elements=cfg.bucket_elements,
                                        learning_rate=lambda s: cfg.optimizer.lr_at(s, cfg.steps),
                                        clip=cfg.optimizer.clip, total_steps=cfg.steps,
                                        diloco=cfg.diloco if cfg.sync == "diloco" else None)
    outcomes = {peer: [] for peer in executors}
    errors = []
    steps, lock = {}, threading.Lock()  # every step's boxes: DiLoCo's overlapped all-reduce spans steps
    for step in range(cfg.steps):
        with lock:
            boxes = steps.setdefault(step, {})

        def work(peer, step=step, boxes=boxes):
            try:
                role = topology.role_of(peer)
                outcomes[peer].append(executors[peer].run_step(step, role, topology,
                                                               link(boxes, lock, peer, steps)))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(peer,)) for peer in executors]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=DEADLINE_S * 2)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
    losses = [o.loss for o in outcomes[rows[0][-1]]]
    if cfg.sync == "diloco":  # each pipeline's own loss: the run's is their mean
        losses = [sum(outcomes[row[-1]][k].loss for row in rows) / len(rows) for k in range(cfg.steps)]
    return losses, executors, outcomes, topology


def params_of(executor):
    return [p.detach().clone() for p in executor.module.parameters()]


BASE = TrainConfig(steps=3, stages=2, replicas=2, global_batch_size=16, micro_batches=4, num_threads=1,
                   bucket_elements=5000)


@pytest.mark.timeout(120)
def test_overlap_and_1f1b_give_the_reference_losses_and_overlap_changes_no_bit():
    torch.set_num_threads(1)
    reference = train_reference(dataclasses.replace(BASE, stages=1, replicas=1))
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        for overlap in (False, True):
            cfg = dataclasses.replace(BASE, schedule=schedule, overlap=overlap)
            losses, executors, _, topology = train_in_threads(cfg)
            for got, want in zip(losses, reference.losses, strict=True):
                assert abs(got - want) <= 1e-4 * abs(want)
            for stage in range(cfg.stages):
                group = topology.group(stage)
                first = params_of(executors[group[0]])
                for peer in group[1:]:
                    assert all(torch.equal(a, b) for a, b in zip(first, params_of(executors[peer]), strict=True))
            runs[(schedule, overlap)] = (losses, [params_of(e) for e in executors.values()])
            overlapped = [e.reducer.overlapped_buckets for e in executors.values()]
            # with overlap every bucket starts before the last backward returns; without, none
            assert overlapped == ([len(e.reducer.buckets) for e in executors.values()] if overlap else [0] * 4)
            assert min(len(e.reducer.buckets) for e in executors.values()) > 3
    for schedule in ("gpipe", "1f1b"):  # overlap reorders messages, not arithmetic
        (l0, p0), (l1, p1) = runs[(schedule, False)], runs[(schedule, True)]
        assert l0 == l1
        assert all(torch.equal(a, b) for x, y in zip(p0, p1, strict=True) for a, b in zip(x, y, strict=True))


@pytest.mark.timeout(120)
def test_1f1b_activation_memory_is_bounded_by_the_stages_not_the_micro_batches():
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, steps=1, stages=3, replicas=1, micro_batches=8, global_batch_size=16,
                              model="tiny")
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        _, _, outcomes, topology = train_in_threads(dataclasses.replace(cfg, schedule=schedule))
        peaks[schedule] = {topology.role_of(p).stage: o[0] for p, o in outcomes.items()}
    for stage in range(cfg.stages):
        gpipe, one_f_one_b = peaks["gpipe"][stage], peaks["1f1b"][stage]
        in_flight = cfg.stages - stage
        assert gpipe.peak_in_flight == cfg.micro_batches
        assert one_f_one_b.peak_in_flight == in_flight
        per_micro_batch = gpipe.peak_activation_bytes / cfg.micro_batches  # every micro-batch is the same size
        assert one_f_one_b.peak_activation_bytes <= in_flight * per_micro_batch * 1.01
        assert one_f_one_b.peak_activation_bytes >= (in_flight - 1) * per_micro_batch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire", ["bf16", "int8", "int4", "int2"])
def test_compressed_wire_keeps_replicas_bit_identical(wire):
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, wire=wire, schedule="1f1b")
    losses, executors, _, topology = train_in_threads(cfg)
    reference = train_reference(dataclasses.replace(BASE, stages=1, replicas=1))
    for stage in range(cfg.stages):
        group = topology.group(stage)
        first = params_of(executors[group[0]])
        for peer in group[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, params_of(executors[peer]), strict=True))
    for got, want in zip(losses, reference.losses, strict=True):
        assert abs(got - want) <= 0.02 * want  # three steps: close to the exact run, not equal
    assert losses != reference.losses or wire == "bf16"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("settings", [dict(wire="int8"), dict(wire="int2", subspace=8)], ids=["int8", "int2-subspace"])
def test_the_reference_with_the_runs_stages_rounds_the_boundaries_as_the_pipeline_does(settings):
    """One pipeline of 2 stages with a lossy wire between them: the single-process reference of the same stages
    (``runtime.stage_boundaries``) gives its losses; the one-stage reference, which sends nothing, does not."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, replicas=1, schedule="1f1b", **settings)
    losses, _, _, _ = train_in_threads(cfg)
    bounded = train_reference(cfg).losses
    plain = train_reference(dataclasses.replace(cfg, stages=1)).losses
    assert losses == pytest.approx(bounded, rel=1e-6, abs=0)
    # the one-stage reference misses by ten times that tolerance and more (int8: 1.9e-5, int2: 1.7e-3); the bounded
    # one meets it (3.5e-7 and 6.5e-8: the threads' float32 sums differ from one process's in the last bits)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, plain, strict=True)) > 10 * 1e-6, (losses, plain)


@pytest.mark.timeout(120)
def test_bucket_size_changes_no_bit():
    """Buckets only regroup the messages: one bucket (the unbucketed all-reduce) and many give the same bits."""
    torch.set_num_threads(1)
    results = []
    for bucket_elements in (1 << 30, 3000):
        losses, executors, _, _ = train_in_threads(dataclasses.replace(BASE, bucket_elements=bucket_elements))
        results.append((losses, [params_of(e) for e in executors.values()],
                        [len(e.reducer.buckets) for e in executors.values()]))
    (l0, p0, n0), (l1, p1, n1) = results
    assert n0 == [1] * 4 and min(n1) > 10
    assert l0 == l1
    assert all(torch.equal(a, b) for x, y in zip(p0, p1, strict=True) for a, b in zip(x, y, strict=True))


class OrderLink(MemoryLink):
    """A MemoryLink that notes every send, (sender, kind, micro-batch), in the order they are handed over."""

    sent: list = []

    def send(self, peer, kind, micro_batch, part, tensor):
        with self.lock:
            OrderLink.sent.append((self.me, kind, micro_batch))
        return super().send(peer, kind, micro_batch, part, tensor)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_with_overlap_a_later_stage_sends_its_last_gradient_before_its_buckets(schedule):
    """The buckets' hooks fire inside the last backward, before the input's gradient exists; a shared uplink
    serves messages in the order they are handed over, so a stage after 0 holds its buckets until that
    gradient, which the stage before waits for, is handed over. Stage 0 sends no gradient: its buckets start
    during the backward."""
    torch.set_num_threads(1)
    OrderLink.sent = []
    cfg = dataclasses.replace(BASE, steps=1, schedule=schedule, overlap=True)
    _, executors, _, topology = train_in_threads(cfg, link=OrderLink)
    for peer in topology.peers:
        mine = [(kind, mb) for who, kind, mb in OrderLink.sent if who == peer]
        shards = [k for k, (kind, _) in enumerate(mine) if kind == "reduce_shard"]
        assert shards and executors[peer].reducer.overlapped_buckets == len(executors[peer].reducer.buckets)
        if topology.role_of(peer).stage == 0:
            continue
        last_gradient = max(k for k, (kind, _) in enumerate(mine) if kind == "activation_grad")
        assert last_gradient < shards[0], mine


@pytest.mark.timeout(120)
def test_a_step_says_how_long_it_waited_for_the_pipeline_and_the_all_reduce():
    """Messages that take d to arrive: in the first step, stage 0 waits about 2d for its first gradient (the
    activation there, the gradient back), stage 1 about d for its first activation, and every member of a
    group about 2d for an all-reduce after its backward pass (its shard there, the reduced shard back).
    "About": less the skew between the threads (one starts its step, or ends its backward, a moment after its
    peer: on a busy machine tens of milliseconds), allowed up to d / 2 with d = 0.2 s. Later steps overlap
    (stage 0 starts step 2 while stage 1 still updates), so only their waits' sum is bounded."""
    torch.set_num_threads(1)
    d = SlowLink.DELAY_S
    cfg = dataclasses.replace(BASE, steps=2, overlap=False, schedule="gpipe")
    losses, _, outcomes, topology = train_in_threads(cfg, link=SlowLink)
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    assert losses == pytest.approx(reference.losses, rel=1e-4)  # a slow link changes the waits, not the result
    for peer, steps in outcomes.items():
        stage = topology.role_of(peer).stage
        first = steps[0].waits
        assert first.recv_s >= (2 * d if stage == 0 else d) - d / 2, (peer, first)
        assert first.reduce_s >= 2 * d - d / 2, (peer, first)
        assert all(o.waits.send_s >= 0.0 for o in steps)
        assert sum(o.waits.recv_s + o.waits.reduce_s for o in steps) >= len(steps) * d, (peer, steps)
    _, _, fast, _ = train_in_threads(dataclasses.replace(cfg, steps=1))
    assert all(o.waits is not None for steps in fast.values() for o in steps)


def test_before_update_runs_once_a_step_before_the_optimizer_changes_anything():
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, steps=3, stages=1, replicas=1)
    topology = Topology.from_rows([["p0"]])
    module = build_stage(cfg.shape, 0, 1, cfg.seed)
    executor = StageExecutor(module, build_optimizer(module, cfg.optimizer), build_data(cfg), cfg.micro_batches,
                             cfg.shape.hidden_size)
    seen = []
    executor.before_update = lambda: seen.append(params_of(executor))
    for step in range(cfg.steps):
        before = params_of(executor)
        executor.run_step(step, topology.role_of("p0"), topology, MemoryLink({}, threading.Lock(), "p0"))
        assert len(seen) == step + 1
        assert all(torch.equal(a, b) for a, b in zip(seen[-1], before, strict=True))  # nothing changed yet
        assert not all(torch.equal(a, b) for a, b in zip(params_of(executor), before, strict=True))


@pytest.mark.timeout(120)
def test_clipping_by_the_global_norm_over_stages_gives_the_single_process_losses():
    """Three stages exchange their squared norms: every peer clips by the single process's global norm, so the
    losses are the reference's and replicas stay bit-identical; the threshold is low enough to clip every
    step, and the losses differ from the unclipped run's."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, stages=3, steps=4, optimizer=OptimizerConfig(
        clip=0.3, lr_schedule="cosine", warmup_steps=2))
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    assert all(norm > cfg.optimizer.clip for norm in reference.grad_norms)  # clipping acted on every step
    unclipped = train_reference(dataclasses.replace(cfg, stages=1, replicas=1, optimizer=dataclasses.replace(
        cfg.optimizer, clip=0.0)))
    assert abs(unclipped.losses[-1] - reference.losses[-1]) > 1e-3
    losses, executors, _, topology = train_in_threads(cfg)
    for got, want in zip(losses, reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    norms = {e.last_grad_norm for e in executors.values()}
    assert len(norms) == 1  # every stage of every pipeline multiplied by the same coefficient
    assert abs(norms.pop() - reference.grad_norms[-1]) <= 1e-4 * reference.grad_norms[-1]
    for stage in range(cfg.stages):
        group = topology.group(stage)
        first = params_of(executors[group[0]])
        assert all(torch.equal(a, b) for a, b in zip(first, params_of(executors[group[1]]), strict=True))


class GarbledNormLink(MemoryLink):
    """Stage 0 of pipeline 0 sends a negative squared norm."""

    def send(self, peer, kind, micro_batch, part, tensor):
        if kind == "grad_norm" and self.me == "p0-0":
            tensor = torch.tensor([-1.0])
        return super().send(peer, kind, micro_batch, part, tensor)


@pytest.mark.timeout(120)
def test_a_garbled_norm_from_another_stage_is_refused():
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, steps=1, optimizer=OptimizerConfig(clip=0.3))
    with pytest.raises(AssertionError, match=r"WireError\(.grad_norm message from p0-0 holds -1\.0"):
        train_in_threads(cfg, GarbledNormLink)


@pytest.mark.timeout(120)
def test_diloco_pipelines_give_the_single_process_diloco_losses():
    """2 stages × 2 pipelines, rounds of 3 inner steps (the last round of 1): no all-reduce within a round,
    each pipeline on its shard; at each round's end the stage groups average their pseudo-gradients and
    take the outer Nesterov step, replicas bit-identical again; the losses are the single-process DiLoCo
    reference's, and not every-step training's."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, steps=7, sync="diloco", diloco=DiLoCoConfig(inner_steps=3))
    reference = train_reference(dataclasses.replace(cfg, stages=1))
    every_step = train_reference(dataclasses.replace(cfg, stages=1, sync="every-step"))
    assert abs(reference.losses[-1] - every_step.losses[-1]) > 1e-3
    losses, executors, _, topology = train_in_threads(cfg)
    assert losses == pytest.approx(reference.losses, rel=1e-5)
    for stage in range(cfg.stages):
        a, b = (params_of(executors[peer]) for peer in topology.group(stage))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # the run ended on a round's end
    full = reference.state
    for peer, executor in executors.items():
        for name, p in executor.module.named_parameters():
            assert torch.allclose(p.detach(), full[name], atol=1e-5, rtol=1e-4), (peer, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inner_steps,overlap_steps", [(2, 0), (3, 1)], ids=["whole-round", "tau-1"])
def test_diloco_overlapped_rounds_give_the_single_process_losses(inner_steps, overlap_steps):
    """``overlap``: each round's all-reduce runs in the background for the next round's first ``tau`` steps
    (tagged with the step that applies it; the whole round, or one step), each replica starting that round
    from its own guess and corrected when the mean is in; 2 × 2 over 7 steps (the last round waits for its
    own mean): the single-process reference's losses and final state, which differ from the undelayed run's."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, steps=7, sync="diloco", diloco=DiLoCoConfig(
        inner_steps=inner_steps, overlap=True, overlap_steps=overlap_steps, outer_lr=0.7, outer_momentum=0.9))
    reference = train_reference(dataclasses.replace(cfg, stages=1))
    undelayed = train_reference(dataclasses.replace(cfg, stages=1, diloco=dataclasses.replace(cfg.diloco,
                                                                                              overlap=False)))
    assert abs(reference.losses[-1] - undelayed.losses[-1]) > 1e-3
    h = inner_steps
    assert reference.losses[:h] == undelayed.losses[:h] and reference.losses[h] != undelayed.losses[h]
    losses, executors, _, topology = train_in_threads(cfg, DelayedLink)
    assert losses == pytest.approx(reference.losses, rel=1e-5)
    for stage in range(cfg.stages):
        a, b = (params_of(executors[peer]) for peer in topology.group(stage))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for peer, executor in executors.items():
        for name, p in executor.module.named_parameters():
            assert torch.allclose(p.detach(), reference.state[name], atol=1e-5, rtol=1e-4), (peer, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap,inner_steps,overlap_steps", [(False, 3, 0), (True, 4, 2)],
                         ids=["blocking", "overlapped-tau-2"])
def test_diloco_fragments_give_the_single_process_losses(overlap, inner_steps, overlap_steps):
    """Streaming DiLoCo's fragments (``fragments`` 2: blocks i mod 2, rounds staggered by H / 2 steps, so a
    stage's groups average half its parameters at a time, fragment 1's first round short): 2 × 2 over 9 steps
    give the single-process reference's losses and final state, which differ from unfragmented rounds'; the
    replicas' anchors agree at every step."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, steps=9, sync="diloco", diloco=DiLoCoConfig(
        inner_steps=inner_steps, overlap=overlap, overlap_steps=overlap_steps, outer_lr=0.7, outer_momentum=0.9,
        fragments=2))
    reference = train_reference(dataclasses.replace(cfg, stages=1))
    whole = train_reference(dataclasses.replace(cfg, stages=1, diloco=dataclasses.replace(cfg.diloco, fragments=1)))
    assert abs(reference.losses[-1] - whole.losses[-1]) > 1e-3
    losses, executors, _, topology = train_in_threads(cfg, DelayedLink if overlap else MemoryLink)
    assert losses == pytest.approx(reference.losses, rel=1e-5)
    for stage in range(cfg.stages):
        a, b = (executors[peer].outer.anchor for peer in topology.group(stage))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for peer, executor in executors.items():
        assert [len(part) for part in executor.parts].count(0) == 0  # each stage holds some of both fragments
        for name, p in executor.module.named_parameters():
            assert torch.allclose(p.detach(), reference.state[name], atol=1e-5, rtol=1e-4), (peer, name)
