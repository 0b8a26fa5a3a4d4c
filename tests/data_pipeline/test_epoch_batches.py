"""``data_pipeline.EpochBatches``: the Protocol names everything the trainer's loop calls on
a batch source, and both batch sources implement it."""

from __future__ import annotations

import ast
import inspect

import torch

import trainer.build
import trainer.loop
import trainer.run_state
from data_pipeline import EpochBatches, SyntheticStream, make_loader

LOADER_NAMES = {"loader", "run.loader"}


def _members() -> set[str]:
    names = set(EpochBatches.__annotations__) | {
        n for n in vars(EpochBatches) if not n.startswith("_") or n in ("__iter__", "__len__")}
    return {n for n in names if not n.startswith("_abc")}


def test_the_protocol_names_every_attribute_the_loop_reads():
    used = set()
    for module in (trainer.loop, trainer.build, trainer.run_state):  # the loop and its parts
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in LOADER_NAMES:
                used.add(node.attr)
    assert used, "the loop reads nothing of its loader?"
    assert used <= _members(), sorted(used - _members())


def test_both_batch_sources_are_epoch_batches(synthetic_data):
    common = {"batch_size": 4, "rank": 0, "world_size": 1, "seed": 0}
    sources = [SyntheticStream(20, 8, device=torch.device("cpu"), **common),
               make_loader(synthetic_data, num_workers=0, **common)]
    for source in sources:
        assert isinstance(source, EpochBatches), type(source)
        source.set_epoch(0)
        images, labels = next(iter(source))[:2]
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        assert source.batches_done == 1 and len(source) >= 1
        state = source.state_dict()
        source.load_state_dict(state)
        assert source.epoch == 0 and source.num_skipped == 0
