"""The verification tests run on one thread: on a loaded 2-core machine torch's second thread only waits."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
