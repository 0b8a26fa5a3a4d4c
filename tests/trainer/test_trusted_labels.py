"""The trainer's head skips its label range check (``PartialFC.forward(trusted_labels=True)``,
no host read) because every source of its batches refuses a label outside
``[0, data.num_classes)`` before the batch is handed on; these tests hold each source to that.

Sources: a shard folder (local or at a URL), ``data.dirs`` (a mixture), the keyed loader of
distillation, the synthetic stream, and the run itself, which refuses a loader whose class
count is not the head's. A library user calling the head with labels of their own keeps the
check (``tests/trainer/test_engine_syncs.py::test_only_trusted_labels_skip_the_range_check``).
"""

from __future__ import annotations

import pytest
import torch
from launch_helpers import make_config

from data_pipeline import SyntheticStream, make_loader
from data_pipeline.errors import DataError
from tools.testbed.harness import write_data
from trainer.dist import DistEnv

CLASSES = 20  # write_data's


def _drain(loader) -> None:
    for _ in loader:
        pass


def _trainer_loader(*overrides: str):
    from trainer.build import build_loader

    cfg = make_config(*overrides, f"data.num_classes={CLASSES}", "data.num_workers=0",
                      "train.batch_size=8")
    return build_loader(cfg, DistEnv(0, 1, 0, torch.device("cpu")))


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    """A 20-class set whose sample 37 is labelled 20 (the first label past the range)."""
    return write_data(tmp_path_factory.mktemp("bad") / "set", labels={37: CLASSES})


@pytest.mark.parametrize("label", [CLASSES, -1])
def test_a_shard_folder_refuses_a_label_out_of_range(tmp_path, label):
    bad = write_data(tmp_path / "set", labels={37: label})
    loader = _trainer_loader(f"data.dir={bad}")
    assert loader.num_classes == CLASSES
    with pytest.raises(DataError, match=rf"has label {label}, outside \[0, {CLASSES}\)"):
        _drain(loader)


def test_a_mixture_refuses_a_label_out_of_range_of_its_folder(synthetic_data, bad_data):
    """``data.dirs``: the bad folder's label 20 is inside the mixture's 40 classes once
    offset, so the refusal must come from the folder's own range, before the offset."""
    loader = _trainer_loader(f"data.dirs=[{synthetic_data},{bad_data}]",
                             f"data.num_classes={2 * CLASSES}")
    assert loader.num_classes == 2 * CLASSES
    with pytest.raises(DataError, match=rf"has label {CLASSES}, outside \[0, {CLASSES}\)"):
        _drain(loader)


def test_a_folder_at_a_url_refuses_a_label_out_of_range(bad_data):
    from tools.remote_servers import FileServer

    server = FileServer(bad_data.parent)
    try:
        loader = _trainer_loader(f"data.dir={server.url}/set")
        with pytest.raises(DataError, match=rf"has label {CLASSES}, outside"):
            _drain(loader)
    finally:
        server.close()


def test_the_distillation_loader_refuses_a_label_out_of_range(bad_data):
    """Distillation reads the same folder with each sample's key (``with_keys``)."""
    loader = make_loader(bad_data, batch_size=8, num_workers=0, with_keys=True)
    with pytest.raises(DataError, match=rf"has label {CLASSES}, outside"):
        _drain(loader)


def test_the_synthetic_stream_draws_every_label_inside_its_classes():
    """Two ranks' whole epoch: each of the 13 classes' 3 images once, no label outside."""
    seen = []
    for rank in range(2):
        stream = SyntheticStream(13, 3, batch_size=4, rank=rank, world_size=2, seed=5)
        assert stream.num_classes == 13
        seen += [y for _, y in stream]
    labels = torch.cat(seen)
    assert labels.dtype == torch.int64 and 0 <= int(labels.min()) and int(labels.max()) < 13
    counts = torch.bincount(labels, minlength=13)
    assert int(counts.min()) >= 2 and int(counts.max()) <= 3  # the last batch may drop some


def test_the_run_refuses_a_loader_of_another_class_count(synthetic_data, one_rank_group):
    """A config not resolved against its data (``data.num_classes`` 11, the folder 20): the
    loader would let labels 11..19 through to a head of 11 classes."""
    from trainer.build import build
    from trainer.config import ConfigError
    from trainer.dist import attach

    cfg = make_config(f"data.dir={synthetic_data}", "data.num_workers=0")
    with pytest.raises(ConfigError, match=r"^data.num_classes=11: the data has 20 classes"):
        build(cfg, attach(torch.device("cpu")))
