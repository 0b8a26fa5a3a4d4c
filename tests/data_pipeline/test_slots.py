"""``SlotPool``: a worker reuses its shared-memory slots in turn, waits while all are in use,
gives up when the reader has gone; the main process gets a private copy."""

import threading

import torch

from data_pipeline.slots import SlotPool


def test_slots_go_round_and_a_full_pool_waits_for_a_release():
    pool = SlotPool(workers=2, slots=2, batch_size=3, size=4)
    first = pool.acquire(1, 0)
    assert pool.acquire(1, 1).data_ptr() != first.data_ptr()
    first.fill_(7)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1, 2)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # both slots in use: chunk 2 waits
    images = pool.receive(1, 0, 2, pin_memory=False)
    waiter.join(5)
    assert got and got[0].data_ptr() == first.data_ptr()  # chunk 2 reuses chunk 0's slot
    assert images.shape == (2, 3, 4, 4) and images.stride(1) == 1  # channels_last
    assert bool((images == 7).all()) and images.data_ptr() != first.data_ptr()  # a copy
    assert pool.acquire(0, 1) is not None  # worker 0's slots are its own


def test_a_waiting_worker_gives_up_when_the_reader_closes():
    pool = SlotPool(workers=1, slots=1, batch_size=1, size=2)
    assert pool.acquire(0, 0) is not None
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(0, 1)))
    waiter.start()
    pool.close()
    waiter.join(5)
    assert got == [None]
    assert isinstance(pool.buffers, torch.Tensor) and pool.buffers.is_shared()
