"""An agent freezes its libraries once (``epoch.freeze_heap``, at its start; a fork server before it forks), so
the full collections during training scan only what the agent made; an epoch starts on a collected heap
(``epoch.settle_heap``): what the epoch before left in reference cycles is freed."""

import gc
import weakref

from p2ptrain.agent.epoch import freeze_heap, settle_heap


class _Node:
    pass


def test_the_libraries_are_frozen_once_and_each_epoch_start_frees_the_last_epochs_cycles():
    try:
        freeze_heap()  # the agent's start
        frozen, scanned = gc.get_freeze_count(), len(gc.get_objects())
        assert frozen > 10_000 and scanned < frozen // 10, (frozen, scanned)  # the libraries are frozen
        node = _Node()
        node.me = node  # a reference cycle, as the last epoch's trainer leaves (hooks holding their owner)
        gone = weakref.ref(node)
        del node
        assert gone() is not None  # until a collection
        settle_heap()  # the next epoch's start
        assert gone() is None
        assert gc.get_freeze_count() == frozen  # nothing the agent made since was frozen: it stays collectable
        made = [_Node() for _ in range(1000)]
        assert len(gc.get_objects()) >= len(made)
    finally:
        gc.unfreeze()
