"""Every grader runs torch on one thread. On a shared machine torch's default (one thread per core) makes the
threads of several jobs fight over the same cores: the seven graders took 67 s that way against 8.5 s pinned.
One thread also makes a grader's timing and its floating-point sums the same on every machine. The setting is
restored after each grader module, so other tests run in the same pytest process keep torch's default."""

import pytest
import torch


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """Module-scoped and autouse, so it is in place before any other module-scoped fixture (A5's training runs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
