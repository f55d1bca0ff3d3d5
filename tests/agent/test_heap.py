"""An epoch starts on a settled heap (``epoch.settle_heap``): what exists then is frozen, so the full
collections during training scan only what training made; and what the epoch before left in reference
cycles is freed."""

import gc
import weakref

from p2ptrain.agent.epoch import settle_heap


class _Node:
    pass


def test_an_epoch_start_frees_the_last_epochs_cycles_and_freezes_the_rest():
    try:
        node = _Node()
        node.me = node  # a reference cycle, as the last epoch's trainer leaves (hooks holding their owner)
        gone = weakref.ref(node)
        gc.freeze()  # the last epoch's start froze it
        del node
        gc.collect()
        assert gone() is not None  # frozen: no collection frees it
        settle_heap()
        assert gone() is None
        frozen, scanned = gc.get_freeze_count(), len(gc.get_objects())
        assert frozen > 10_000 and scanned < frozen // 10, (frozen, scanned)  # the libraries are frozen
        made = [_Node() for _ in range(1000)]
        assert len(gc.get_objects()) >= scanned + len(made)  # what comes after is collected as usual
    finally:
        gc.unfreeze()
