"""One run on one rank: :class:`Run`, what ``trainer.build.build`` makes and the counters the
loop advances, and :func:`data_counts`, the counts a metrics record reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import Config
from trainer.dist import DistEnv
from trainer.stopping import StopRequests
from trainer.telemetry.logger import RunLogger

if TYPE_CHECKING:
    from data_pipeline.epoch_batches import EpochBatches
    from trainer.engine import Engine


@dataclass
class Run:
    """One run on one rank: what :func:`build` makes and the counters the loop advances."""

    cfg: Config
    env: DistEnv
    engine: Engine
    loader: EpochBatches
    log: RunLogger
    total: int  # optimisation steps of the whole run
    steps_per_epoch: int
    accum: int = 1  # micro-batches per rank per step (trainer.config.accumulation)
    step: int = 0  # steps done
    epoch: int = 0
    saved: Path | None = None  # the newest checkpoint this process wrote or resumed from
    bad_steps: int = 0  # skipped as non-finite, in all
    skipped_steps: int = 0  # dropped by DeepSpeed's fp16 loss scaler (overflow), in all
    skipped_samples: int = 0  # corrupt samples: the most any epoch met (all ranks)
    bad_in_a_row: int = 0
    step_started: float = 0.0  # time.monotonic() when the current step began
    storage_seen: tuple[int, int, int] = (0, 0, 0)  # storage retries, wait ms, stream ms
    stops: StopRequests = field(default_factory=StopRequests)  # this rank's, read at each step


def data_counts(run: Run) -> dict[str, int | float]:
    """Collective: corrupt samples and samples repeated to pad (all ranks), and the steps
    skipped as non-finite (``bad_steps``) or by the fp16 loss scaler (``skipped_steps``).
    Every epoch meets the same corrupt files, so ``skipped_samples`` is the most any one
    epoch has counted, not a sum that grows by them each epoch.

    Reading a folder at a URL, also the share of the time the loader's workers (all ranks)
    waited on storage since the last record (``storage_wait_share``,
    data_pipeline.epoch_batches.StorageWait) and the reads retried since this process
    started (``storage_retries``); in the same gather, so no host sync is added."""
    from partial_fc.distributed import gather_ints

    loader, storage = run.loader, run.loader.storage
    counts = gather_ints([loader.num_skipped, loader.num_padded, storage.retries,
                          round(1000 * storage.wait_s), round(1000 * storage.stream_s)],
                         run.env.device, run.env.group).sum(0).tolist()
    run.skipped_samples = max(run.skipped_samples, counts[0])
    out = {"skipped_samples": run.skipped_samples, "padded_samples": counts[1],
           "bad_steps": run.bad_steps, "skipped_steps": run.skipped_steps,
           "world_size": run.env.world_size, "accumulation": run.accum}
    if loader.reads_url:
        (_, waited, streamed), now = run.storage_seen, tuple(counts[2:])
        out["storage_wait_share"] = (now[1] - waited) / max(now[2] - streamed, 1)
        out["storage_retries"] = now[0]
        run.storage_seen = now
    return out
