"""Shared-memory batch slots: how decoded images travel from a DataLoader worker to the main
process without a new shared-memory segment per chunk.

Torch sends a tensor between processes by moving its storage into a fresh shared-memory
segment (a copy) and mapping it again on the other side. On the project's CPU machine that
costs about as much per image as decoding it: most of it is the page faults of the fresh
segment (measured 13-16 ms per 128-image chunk under load, against 0.3 ms to fill reused
memory). So each worker decodes into one of ``slots`` buffers of a segment allocated once per
epoch; the main process copies a received chunk out (one memcpy, into page-locked memory for
an asynchronous copy to the GPU when asked) and releases its slot, and a worker that finds
all its slots in use waits for one. A worker's chunks are released in the order it made them,
so one counter per worker says which slots are free.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch


class SlotPool:
    """``slots`` uint8 ``[batch_size, size, size, 3]`` buffers per worker in one shared
    segment, plus a released-chunk counter per worker; built in the main process before the
    workers start (they receive it pickled, sharing the memory)."""

    def __init__(self, workers: int, slots: int, batch_size: int, size: int):
        shape = (workers, slots, batch_size, size, size, 3)
        self.buffers = torch.empty(shape, dtype=torch.uint8).share_memory_()
        self.released = torch.zeros(workers + 1, dtype=torch.int64).share_memory_()
        self.slots = slots  # released[workers] = 1: the epoch's reader has gone
        self.reader = os.getpid()

    def acquire(self, worker: int, index: int) -> torch.Tensor | None:
        """In worker ``worker``: the buffer for its chunk number ``index``, once the chunk
        ``index - slots`` is released; None when the main process stopped reading or died
        (a worker waiting here does not reach DataLoader's own check of its parent)."""
        released = self.released.numpy()  # polled: numpy reads cost a tenth of torch's
        while index - released[worker] >= self.slots:
            if released[-1] or os.getppid() != self.reader != os.getpid():
                return None
            time.sleep(0.0002)
        return self.buffers[worker, index % self.slots]

    def receive(self, worker: int, index: int, count: int, pin_memory: bool) -> torch.Tensor:
        """In the main process: the first ``count`` images of that chunk copied out, as
        ``[count, 3, size, size]`` (channels_last strides); its slot is released."""
        source = self.buffers[worker, index % self.slots, :count]
        out = torch.empty(source.shape, dtype=torch.uint8, pin_memory=pin_memory)
        np.copyto(out.numpy(), source.numpy())  # a memcpy; see data_pipeline.epoch_batches.concat
        self.released[worker] += 1
        return out.permute(0, 3, 1, 2)

    def close(self) -> None:
        """The main process stops reading: waiting workers give up."""
        self.released[-1] = 1
