"""Whether the head a config asks for can be allocated at all on the machine: the one check of
``data.num_classes`` (often filled from a manifest.json, which anyone can edit) against memory,
made before ``PartialFC`` allocates its weight (docs/readers.md; docs/design.md, invariant 5).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from partial_fc.memory import head_memory

if TYPE_CHECKING:
    from trainer.config.machine import Machine
    from trainer.config.schema import Config


def head_memory_errors(cfg: Config, machine: Machine) -> list[tuple[str, str]]:
    """A head whose weight and optimizer state alone (``partial_fc.memory``, the formulas of
    ``launch.plan``) exceed the memory of the device each rank trains on (a GPU, or its share
    of the node's memory): refused before the head allocates them at start, where a
    manifest.json claiming 10^12 classes asked for petabytes. The rest of a step needs more,
    so a refused head never fits; whatever passes may still not."""
    on_gpu = cfg.device in ("cuda", "auto") and machine.cuda
    have = machine.gpu_memory if on_gpu else (
        None if machine.host_memory is None else machine.host_memory // machine.local_ranks)
    classes, world, head = cfg.data.num_classes, machine.world_size, cfg.head
    if have is None:
        return []
    need = head_memory(classes, world, cfg.backbone.embedding_size,
                       cfg.train.batch_size * world, head.sample_rate,
                       max_tile_bytes=head.max_tile_mib << 20,
                       max_update_bytes=head.max_update_mib << 20, state_dtype=head.state_dtype,
                       optimizer=cfg.optim.name, precision=cfg.engine.precision,
                       subcenters=cfg.margin.subcenters)
    if need.weight + need.optimizer_state <= have:
        return []
    where = "one GPU" if on_gpu else (f"a rank's share of this node's "
                                      f"{machine.host_memory / 2**30:.4g} GiB "
                                      f"({machine.local_ranks} ranks on it)")
    return [("data.num_classes", f"data.num_classes={classes}: the head's weight and optimizer "
             f"state take {(need.weight + need.optimizer_state) / 2**30:.4g} GiB per rank "
             f"({world} ranks), over the {have / 2**30:.4g} GiB of {where}; check the data's "
             "manifest.json, or launch more ranks (python -m launch.plan says what fits)")]
