"""The plan record's layer split (additive field ``layers``: blocks per stage)."""

import dataclasses
import random

import base58
import pytest

from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.records import PlanRecord, RecordError, decode_record

_rng = random.Random(7)
PEERS = sorted(base58.b58encode(b"\x12\x20" + _rng.randbytes(32)).decode() for _ in range(3))


def _plan(**extra):
    return PlanRecord.from_plan_json(1, PEERS[:2], {"stages": 2, "replicas": 1, "cost_s": 5.0,
                                                    "pipelines": [[0, 1]], **extra})


def test_a_planned_split_travels_in_the_record_and_older_records_mean_even():
    plan = _plan(layers=[[0, 6], [6, 8]])
    assert plan.layers == (6, 2)
    assert plan.layer_ranges == ((0, 6), (6, 8))
    assert decode_record(RecordKind.PLAN, plan.encode()) == plan
    even = _plan()
    assert even.layers == () and even.layer_ranges is None
    assert "layers" not in even._fields()  # a plan without a split is the bytes it always was
    assert decode_record(RecordKind.PLAN, even.encode()).layer_ranges is None


@pytest.mark.parametrize("layers", [(6,), (6, 0), (6, 2, 1)])
def test_bad_splits_are_refused(layers):
    with pytest.raises(RecordError):
        dataclasses.replace(_plan(), layers=layers)
