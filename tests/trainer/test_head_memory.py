"""``data.num_classes`` (a manifest's, which anyone can edit) against the memory its head's
weight and optimizer state take on each rank, checked with the config, before ``PartialFC``
allocates them (trainer.config.head_memory)."""

from __future__ import annotations

from pathlib import Path

from trainer.config import Machine, load_config
from trainer.config.resolve import resolve_config

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
GIB = 1 << 30
# SGD at D=512, fp32: the weight and its momentum, 2 x 4 x 512 bytes a class on its rank
PER_CLASS = 4096


def _class_errors(classes: int, machine: Machine, *given: str) -> list[str]:
    from data_pipeline.manifest import Manifest, ShardInfo

    cfg = load_config(SMOKE, ["backbone.embedding_size=512", "optim.name=sgd", "device=cpu",
                              "engine.type=ddp", *given], resolve=False)
    manifest = Manifest(classes, 10**7, (ShardInfo("a.tar", 10**7, 1),))
    return [message for key, message in resolve_config(cfg, manifest, machine).errors
            if key == "data.num_classes"]


def test_a_manifest_claiming_a_trillion_classes_is_one_line_before_the_head_exists():
    (line,) = _class_errors(10**12, Machine(host_memory=64 * GIB))
    assert line == ("data.num_classes=1000000000000: the head's weight and optimizer state "
                    "take 3.815e+06 GiB per rank (1 ranks), over the 64 GiB of a rank's share "
                    "of this node's 64 GiB (1 ranks on it); check the data's manifest.json, or "
                    "launch more ranks (python -m launch.plan says what fits)")


def test_the_bound_is_each_ranks_share_of_its_node_or_its_gpu():
    classes = 4 * 3 * GIB // PER_CLASS  # 3 GiB of head on each of 4 ranks
    assert _class_errors(classes, Machine(world_size=4, host_memory=8 * GIB)) == []
    (crowded,) = _class_errors(classes, Machine(local_ranks=4, world_size=4,
                                                host_memory=8 * GIB))  # 2 GiB a rank
    assert "take 3 GiB per rank (4 ranks), over the 2 GiB of a rank's share of this " \
           "node's 8 GiB (4 ranks on it)" in crowded
    full = 4 * 2 * GIB // PER_CLASS  # 2 GiB on each rank: fits exactly; a class more does not
    shared = Machine(local_ranks=4, world_size=4, host_memory=8 * GIB)
    assert _class_errors(full, shared) == [] and len(_class_errors(full + 1, shared)) == 1
    gpu = Machine(gpus=1, bf16=True, nccl=True, world_size=4, gpu_memory=2 * GIB,
                  host_memory=1024 * GIB)
    (small,) = _class_errors(classes, gpu, "device=cuda")
    assert "over the 2 GiB of one GPU" in small
    assert _class_errors(classes, Machine(world_size=4)) == []  # memory unknown: not checked
