"""The ``engine:`` and ``dist:`` sections: how the backbone is replicated, at what precision
and with which collectives' settings, and how long a collective waits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer.config.sections.base import NonNegInt, PosFloat, Section

ZeroSetting = Literal["overlap_comm", "contiguous_gradients", "reduce_bucket_size",
                     "allgather_bucket_size"]
"""The keys of DeepSpeed's ``zero_optimization`` section ``engine.zero_settings`` may set."""


class EngineConfig(Section):
    type: Literal["ddp", "deepspeed"] = Field(
        "ddp", description="how the backbone is replicated: torch DDP or DeepSpeed ZeRO (the "
        "head is always sharded by class)"
    )
    zero_stage: Literal[0, 1, 2] = Field(1, description="deepspeed only: ZeRO stage")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="backbone compute precision (margins and softmax stay fp32); fp16 "
        "needs deepspeed and a GPU"
    )
    broadcast_buffers: bool = Field(
        True, description="ddp: copy rank 0's buffers (BatchNorm statistics) to every rank "
        "before each forward; false keeps each rank's own (arcface_torch), averaged at saves"
    )
    grad_compression: Literal["none", "fp16"] = Field(
        "none", description="ddp: all-reduce the backbone's gradients in fp16 (torch's "
        "fp16_compress_hook, as arcface_torch registers it): half the traffic, fp16 rounding"
    )
    cpu_shm_comm: bool = Field(
        False, description="deepspeed on CPU: use its shared-memory all-reduce (costs a ~30-50 "
        "s JIT build) instead of the gloo group"
    )
    channels_last: bool = Field(True, description="CUDA only (CPU ignores it): backbone and "
                                "input channels_last, the layout tensor-core convolutions read "
                                "(the speed-up: docs/benchmarks.md)")
    cudnn_benchmark: bool = Field(
        True, description="CUDA only: cuDNN times its convolution algorithms on the first "
        "step (inputs are a fixed size); the chosen algorithms, so the last bits, may differ "
        "between invocations"
    )
    compile: bool = Field(
        False, description="torch.compile (inductor) the backbone that trains, inside DDP or "
        "DeepSpeed; evaluation and checkpoints use the plain module. Costs compile time at the "
        "first steps (again at each new input shape) and needs a C++ compiler on CPU"
    )
    one_rank_ddp: bool = Field(
        False, description="ddp on one rank: wrap the backbone in DistributedDataParallel "
        "anyway; false trains it unwrapped there (the same gradients and checkpoints, without "
        "DDP's hooks and buckets); true only to measure them"
    )
    prefetch: bool = Field(
        True, description="CUDA only: each batch's copy to the GPU queued on a side stream, "
        "from pinned memory, as the loader hands it over, ahead of its step; false copies it "
        "on the step's own stream"
    )
    fused_updates: bool = Field(
        True, description="the head's SGD step over every row (dense fp32 gradient: r = 1) in "
        "torch's fused kernel, and on CUDA the backbone's gradient norm in foreach kernels; "
        "false: the chunked update and per-tensor norms (to measure them)"
    )
    zero_settings: dict[ZeroSetting, NonNegInt] = Field(
        {}, description="deepspeed only: values put into its zero_optimization section "
        "(overlap_comm, contiguous_gradients: 0/1; reduce_bucket_size, allgather_bucket_size: "
        "elements); unset ones keep DeepSpeed's defaults"
    )


class DistConfig(Section):
    timeout_s: PosFloat = Field(
        300.0, description="seconds a collective may wait for the other ranks before the run "
        "ends with a message naming the step (a stopped or hung rank); raise it for evaluation "
        "or checkpoints that take longer on one rank. A rank outlives a dead launcher by at "
        "most this + 20 s"
    )
