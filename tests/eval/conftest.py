import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models decode an order of magnitude faster on one intra-op thread, above all on a busy machine.

    Restored after the module, so no other test sees a changed thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
