"""The codecs' CPU time in the simulated objective (issue 31): on clusters where it is the only difference,
the step grows by exactly what the module docstring ("Codecs") says, hand-computed: per micro-batch at both
ends of a hop, and per all-reduce (encode at the sender, decode at the owner, the sum's encode, decode at
every member), once a round with DiLoCo; and nothing at all without it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.planning import make_objective
from p2ptrain.planning.cluster import Cluster, Device
from p2ptrain.planning.simulated import StepProfile, StepWorkload

ENCODE = (0.3, 0.5, 0.7)  # seconds per GB: activations, their gradients, data-parallel gradients
DECODE = (0.11, 0.13, 0.17)


def uniform(n: int, latency_ms: float = 10.0, bandwidth_gbps: float = 8.0, access_gbps: float | None = None
            ) -> Cluster:
    off = 1 - np.eye(n)
    access = None if access_gbps is None else np.full(n, access_gbps)
    return Cluster(tuple(Device(f"d{i}") for i in range(n)), latency_ms * off, bandwidth_gbps * off + np.eye(n),
                   uplink_gbps=access, downlink_gbps=access)


def step_pair(cluster: Cluster, stages: int, sigma: np.ndarray, activation_gb: float = 0.0,
              gradient_gb: float = 0.0, **profile) -> tuple[float, float]:
    """The simulated step without and with the codecs' time."""
    base = StepProfile(**profile)
    with_codecs = dataclasses.replace(base, encode_s_per_gb=ENCODE, decode_s_per_gb=DECODE)
    return tuple(make_objective("simulated", cluster, StepWorkload(activation_gb, gradient_gb, step=step),
                                stages).simulate(sigma).predicted_s for step in (base, with_codecs))


def test_a_pipeline_hop_pays_the_encode_and_decode_of_both_directions():
    """Two stages, one micro-batch: the step is one chain, F0 → hop → F1, B1 → hop → B0; the codecs add the
    activation's encode (stage 0) and decode (stage 1), the gradient's encode (stage 1) and decode (stage 0)."""
    x = 0.1
    without, with_codecs = step_pair(uniform(2), 2, np.array([[0, 1]]), activation_gb=x, forward_s=(0.01, 0.02),
                                     backward_s=(0.02, 0.04))
    assert with_codecs - without == pytest.approx(x * (ENCODE[0] + DECODE[0] + ENCODE[1] + DECODE[1]))


def test_a_middle_stage_pays_both_ends_on_every_micro_batch():
    """Three stages, compute-bound (links are fast), 4 micro-batches of GPipe: the middle stage does the most
    codec work a micro-batch (decode in and encode out, both ways) and becomes the bottleneck of the flow
    shop, so the step grows by the ends' chain plus (M − 1) × the middle stage's extra."""
    m, x = 4, 0.4
    forward, backward = (0.05, 0.05, 0.05), (0.1, 0.1, 0.1)
    without, with_codecs = step_pair(uniform(3, latency_ms=0.0, bandwidth_gbps=1e6), 3, np.array([[0, 1, 2]]),
                                     activation_gb=x * m, micro_batches=m, forward_s=forward, backward_s=backward)
    first, last = x * ENCODE[0], x * DECODE[0]
    middle_f, middle_b = x * (ENCODE[0] + DECODE[0]), x * (ENCODE[1] + DECODE[1])
    # the forward flow shop: F0 + F1 + F2 + (M − 1) · max F; the backward likewise
    forward_extra = first + middle_f + last + (m - 1) * middle_f
    backward_extra = x * ENCODE[1] + middle_b + x * DECODE[1] + (m - 1) * middle_b
    assert with_codecs - without == pytest.approx(forward_extra + backward_extra)


@pytest.mark.parametrize("access_gbps", [None, 4.0], ids=["links", "access-links"])
def test_an_all_reduce_pays_shard_encode_and_decode_both_phases(access_gbps):
    """One stage, two replicas: the gradient's all-reduce is a chain of a shard encoded (with error
    feedback), sent, decoded by its owner; the sum encoded, sent, decoded: 2 (e + d) per shard of g / 2."""
    g = 0.2
    without, with_codecs = step_pair(uniform(2, access_gbps=access_gbps), 1, np.array([[0], [1]]), gradient_gb=g,
                                     backward_s=(0.05,))
    assert with_codecs - without == pytest.approx(2 * (ENCODE[2] + DECODE[2]) * g / 2)


def test_more_replicas_wait_for_every_shard_encoded_and_decoded():
    """Four replicas: D − 1 shards encoded before they leave, D − 1 decoded at the owner, the sum encoded once
    and D − 1 sums decoded (``rs_*``, ``ag_*``); with the links the same everywhere, the chain of each."""
    d, g = 4, 0.4
    without, with_codecs = step_pair(uniform(d), 1, np.arange(d)[:, None], gradient_gb=g, backward_s=(0.05,))
    shard = g / d
    expected = shard * ((d - 1) * ENCODE[2] + (d - 1) * DECODE[2] + ENCODE[2] + (d - 1) * DECODE[2])
    assert with_codecs - without == pytest.approx(expected)


def test_diloco_pays_the_all_reduce_codecs_once_a_round():
    g, h = 0.2, 5
    without, with_codecs = step_pair(uniform(2), 1, np.array([[0], [1]]), gradient_gb=g, backward_s=(0.05,),
                                     sync_every=h)
    assert with_codecs - without == pytest.approx(2 * (ENCODE[2] + DECODE[2]) * g / 2 / h)


def test_buckets_pay_the_same_codec_time_in_all_and_overlap_it():
    """Overlapped buckets: the same seconds of codec work in all, some of it hidden behind the backward pass,
    so the step grows by no more than without overlap and by more than nothing."""
    g, sigma = 0.4, np.array([[0], [1]])
    kwargs = dict(gradient_gb=g, backward_s=(0.5,))
    plain = step_pair(uniform(2), 1, sigma, **kwargs)
    overlapped = step_pair(uniform(2), 1, sigma, bucket_gb=0.1, **kwargs)
    assert 0 < overlapped[1] - overlapped[0] <= plain[1] - plain[0] + 1e-12


def test_the_closed_form_adds_the_codecs_to_compute_and_to_every_group():
    x, g, m = 0.1, 0.2, 2
    cluster = uniform(4)
    base = StepProfile(micro_batches=m, forward_s=(0.01, 0.02), backward_s=(0.02, 0.04))
    coded = dataclasses.replace(base, encode_s_per_gb=ENCODE, decode_s_per_gb=DECODE)
    objs = [make_objective("simulated", cluster, StepWorkload(x * m, g, step=p), 2) for p in (base, coded)]
    members = np.array([0, 2])
    exchange = g / 2 * (2 * ENCODE[2] + 2 * DECODE[2])  # D = 2: one shard each way, both phases
    assert objs[1].group_terms(members) - objs[0].group_terms(members) == pytest.approx([exchange] * 2)
    # stage 0 encodes the activations and decodes their gradients, stage 1 the other way round
    compute = np.array([0.03 + x * (ENCODE[0] + DECODE[1]), 0.06 + x * (DECODE[0] + ENCODE[1])])
    pipeline = objs[1].combine([0.0, 0.0], [0.0]).pipeline_s  # no hop: Σ C_j + (M − 1) · max C_j
    assert pipeline == pytest.approx(compute.sum() + (m - 1) * compute.max())


def test_no_codec_time_changes_nothing():
    rng = np.random.default_rng(3)
    cluster = uniform(4, access_gbps=2.0)
    sigma = np.array([[0, 1], [2, 3]])
    profile = StepProfile(micro_batches=3, forward_s=tuple(rng.uniform(0.01, 0.1, 2)),
                          backward_s=tuple(rng.uniform(0.01, 0.1, 2)), schedule="1f1b", bucket_gb=0.05, clip=True)
    explicit = dataclasses.replace(profile, encode_s_per_gb=(0, 0, 0), decode_s_per_gb=(0.0, 0.0, 0.0))
    steps = [make_objective("simulated", cluster, StepWorkload(0.3, 0.2, step=p), 2).simulate(sigma).step_s
             for p in (profile, explicit)]
    assert steps[0] == steps[1]


def test_the_profile_checks_and_scales_codec_times():
    with pytest.raises(ValueError, match="encode_s_per_gb"):
        StepProfile(encode_s_per_gb=(0.1, -1.0, 0.0))
    with pytest.raises(ValueError, match="decode_s_per_gb"):
        StepProfile(decode_s_per_gb=(0.1, 0.2))
    with pytest.raises(ValueError, match="decode_s_per_gb"):
        StepProfile(decode_s_per_gb=(0.1, float("nan"), 0.0))
    scaled = StepProfile(encode_s_per_gb=ENCODE, decode_s_per_gb=DECODE).scaled(10.0)
    assert scaled.encode_s_per_gb == pytest.approx(tuple(10 * v for v in ENCODE))
    assert scaled.decode_s_per_gb == pytest.approx(tuple(10 * v for v in DECODE))
    # what the leader's summary holds (dataclasses.asdict: lists) rebuilds the same profile
    raw = dataclasses.asdict(scaled)
    assert StepProfile(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}) == scaled
