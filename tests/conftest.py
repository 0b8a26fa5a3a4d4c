"""Suite-wide fixtures."""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import pytest
import torch

# Each cache a test may write, and a rank or subprocess it starts (they inherit the
# environment): torch.compile's kernels and graphs, Triton's (the kernels-aot compiles
# included), W&B's, matplotlib's, and whatever keeps to XDG_CACHE_HOME (~/.cache). Left at their
# defaults they are shared by every run on the machine, and a run stopped while it wrote one
# left a file the next run loaded (torch.compile: "main.so: file too short").
PRIVATE_CACHES = {
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton/cache",
    "TRITON_HOME": "triton",
    "WANDB_DIR": "wandb",
    "WANDB_CACHE_DIR": "wandb/cache",
    "WANDB_CONFIG_DIR": "wandb/config",
    "WANDB_DATA_DIR": "wandb/data",
    "WANDB_ARTIFACT_DIR": "wandb/artifacts",
    "MPLCONFIGDIR": "matplotlib",
    "XDG_CACHE_HOME": "xdg",
}


@pytest.fixture(autouse=True)
def private_caches(tmp_path, monkeypatch):
    """Every cache of :data:`PRIVATE_CACHES` under this test's ``tmp_path/caches`` (made only
    when something writes there): nothing one test or one run leaves behind reaches another.

    torch.compile's precompiled headers are off: inductor keeps them in the default folder
    whatever TORCHINDUCTOR_CACHE_DIR says (a path taken at import), and a truncated one fails
    every later C++ compile ("while reading precompiled header"). Each kernel then parses the
    headers itself: about as fast as building a fresh 150 MB header for every test."""
    for variable, folder in PRIVATE_CACHES.items():
        monkeypatch.setenv(variable, str(tmp_path / "caches" / folder))
    monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")  # read at import
    inductor = sys.modules.get("torch._inductor.config")  # already imported: its own patch
    with inductor.patch(cpp_cache_precompile_headers=False) if inductor else nullcontext():
        yield


@pytest.fixture(autouse=True)
def wandb_disabled(monkeypatch):
    """``WANDB_MODE=disabled`` for every test and whatever it starts (ranks, torchrun, make),
    unless the test deletes it: the tests of W&B itself do (``test_logging.py``'s fake module,
    ``test_user_output.py``'s default offline run). A real offline run costs a rank about
    1.2 s and leaves W&B's service process and its threads in the process that started it,
    for the life of a pytest worker when the run was in-process: a test that ran the real
    W&B here ends its service afterwards (``wandb.teardown``, which a process's exit runs)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    yield
    wandb = sys.modules.get("wandb")
    if "WANDB_MODE" not in os.environ and hasattr(wandb, "teardown"):  # not test_logging's fake
        wandb.teardown()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread per test process: CI has 2 cores shared by two pytest-xdist workers,
    and torch's default of 2 threads each made a full-width iResNet forward ~10x slower
    (measured 12.7 s vs 1.3 s). Spawned ranks and torchrun children set their own threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo group in this process (cheap: no spawn), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    # DeepSpeed keeps a clone of the world group for the life of the process (there is no
    # public reset): a later test's engine in this worker would start on the destroyed one
    # ("Group ... is not registered"), as it did once the tests ran in another order.
    deepspeed_groups = sys.modules.get("deepspeed.utils.groups")
    if deepspeed_groups is not None:
        deepspeed_groups._WORLD_GROUP = None


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory):
    """A small synthetic training set: 20 classes x 8 images (112x112), written once."""
    from data_pipeline import write_synthetic_dataset

    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic_dataset(root, num_classes=20, images_per_class=8, seed=0)
    return root


@pytest.fixture(scope="module")
def s3_store():
    """moto's S3 server on loopback (tools.remote_servers.S3Server), the standard AWS_*
    variables pointing at it while the module runs, and a bucket ``bucket`` in it."""
    from tools.remote_servers import S3Server, clear_clients

    server = S3Server()
    server.make_bucket("bucket")
    with pytest.MonkeyPatch.context() as env:
        for name, value in server.environment().items():
            env.setenv(name, value)
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service
        clear_clients()
        yield server
        clear_clients()
    server.close()
