"""PartialFC: the class-sharded cosine-margin softmax head (arXiv:2203.15565).

Data flow of one forward, on every rank of ``process_group`` (see ``distributed`` for the
gradient convention)::

    e_local [n_r, D] --normalise--> all_gather --> E [N, D]      (labels likewise -> Y [N])
    sample local classes (training, r < 1)   -> W_s [S_r, D] rows of this rank's shard
    inv = 1 / ||W_s|| [S_r]; class_tile_stats (a partial_fc.tiles back-end), no grad:
      per row over non-target columns: max and sum-exp of s * cos, sum of cos (chunked over
      classes: never an [N, S_r] buffer), target cosines from the gathered target rows
    no-grad all-reduce of global statistics  -> AdaCos s_t, stats   (partial_fc.batch_stats;
      dynamic AdaCos: the tile statistics at s_{t-1} for B_avg, then again at s_t)
    the margin sees the global batch (partial_fc.margins.step, step_terms): its psi, EMAs,
      optional non-target transform (then the tile statistics again, torch tiles), loss terms
    partial_fc.softmax (one autograd Function): target logits s * psi(cos_target);
      max: all-reduce MAX (detached); sum-exp and shifted target logit: all-reduce SUM
      loss = mean_i [ log(sum_k exp(z_ik - m_i)) - (z_iy - m_i) ]   identical on all ranks
      backward: class_tile_grads recomputes the cosines chunk by chunk

The result equals ``F.cross_entropy`` on the full ``[N, C]`` logits of one process: the
embedding gradient is exactly ``dL/de_local`` and each rank's ``weight.grad`` holds exactly
its rows of ``dL/dW``: dense at ``sample_rate == 1`` (and in eval), else a sparse COO tensor
holding the sampled rows only (no dense ``[num_local, D]`` gradient; ``partial_fc.optim``
reads it). Nothing is scaled by the world size;
compensating data-parallel gradient averaging of the backbone is the engine's job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partial_fc import distributed as dist_ops
from partial_fc.angles import angle_sample
from partial_fc.aux_losses import AuxLosses
from partial_fc.batch_stats import GlobalStats, global_stats, stats_readout
from partial_fc.head_checks import check_head_args, check_inputs, check_label_range
from partial_fc.init import derive_seed, init_rows_
from partial_fc.ledger import RowLedger
from partial_fc.margins import Margin
from partial_fc.margins.step import MarginBatch
from partial_fc.metric_names import SUBCENTER_SHARE
from partial_fc.partition import split_evenly
from partial_fc.rows import SampledRows
from partial_fc.sampling import StepSample, columns_in, local_targets, sample_classes
from partial_fc.softmax import Shard, margin_softmax_loss
from partial_fc.step_terms import finish, step_terms
from partial_fc.subcenters import DominantShare, expand_rows
from partial_fc.tiles.reference import chunk_columns
from partial_fc.tiles.selfcheck import CheckedTiles

__all__ = ["PartialFC"]


class PartialFC(nn.Module):
    """Class-sharded margin softmax head (the why of each choice: docs/design.md, "The head").

    Args:
        embedding_size: ``D``.
        num_classes: ``C``, split contiguously over the ranks of ``process_group``.
        margin: from ``partial_fc.build_margin``; owns the scale (fixed or AdaCos).
        sample_rate: ``r in [0, 1]``; in training each rank keeps every positive of the
            global batch plus random negatives, ``max(ceil(r * num_local), #positives)`` rows
            and at least one: ``r = 0`` is positives only (arcface_torch's PartialFC_V2 at
            ``sample_rate = 0``), one random row on a rank that owns none, where it keeps none.
        process_group: ``None`` = WORLD, resolved when called; no initialised process group
            = one rank (no collectives at all).
        seed: seeds the weight init (per global class) and the negative sampling.
        kernel: ``"torch"``, ``"triton"`` (CUDA) or ``"auto"`` (triton for CUDA tensors when
            it is installed): the class-tile passes (``partial_fc.tiles``). The first forward
            on a device that runs the Triton kernels checks them against the torch path on a
            slice of that step (``partial_fc.tiles.selfcheck``, collective): on a failure
            ``"auto"`` goes on with torch there (``take_notes`` says so), ``"triton"`` raises.
        max_tile_bytes: the torch path's budget of fp32 ``[N, chunk]`` cosines per chunk.
        state_dtype: dtype of ``weight``, its gradient and optimizer state: ``torch.float32``
            or ``torch.bfloat16`` (half the memory; bf16 matmul operands, fp32 softmax).
        init: ``"per_class"`` (a class's initial row depends on ``(seed, class)`` only) or
            ``"per_rank"`` (every rank starts from rank 0's rows: insightface's arcface_torch).
        loss_cap: report each sample's loss as at most this (arcface_torch clamps
            ``p_target`` at 1e-30: ``-ln 1e-30``); the gradient stays the uncapped one.
        device: where ``weight`` is created (default: the CPU); give the training device at
            large class counts, so no whole shard passes through host memory.
        subcenters: ``K`` centres per class (sub-center ArcFace, ``partial_fc.subcenters``):
            ``weight`` is ``[K * num_local, D]``, class-major, a class's cosine the largest of
            its ``K``; the sampler samples classes (all ``K`` rows of each); the class tiles
            take the torch path (the Triton kernels have no ``K``-way max; ``take_notes`` says
            so); ``stats`` adds ``subcenter_dominant_share``.
        aux_losses: ArcFace's Intra-, Inter- and Triplet-Loss weights
            (``partial_fc.aux_losses``); None = all off.
        grad_filter: the Triton kernels' filtered backward (``partial_fc.tiles.filtered``):
            skip the class tiles whose ``|dL/dcos|`` all sit below a bound under which the
            skipped sum stays within the bf16 rounding the kernels already give ``G'``; off
            (exact) by default, until a GPU shows it leaves training unchanged; the torch path
            and margins with a non-target transform stay exact.

    ``forward(embeddings [n_local, D], labels [n_local] int64) -> loss`` (0-d fp32): the mean
    loss of the **global** batch, identical on all ranks; ranks may pass different
    ``n_local``. A loop that must not wait for the device passes ``sizes`` and, when its
    data source has already refused out-of-range labels, ``trusted_labels`` (see ``forward``).

    State (``state_dict``): ``weight`` ``[K * num_local, D]`` (this rank's rows, classes
    ``class_start ..``); ``step`` (training forwards so far, replicated, a host int saved as
    int64; seeds the sampler, SphereFace's lambda, the margin warm-up); ``margin.scale.s``
    (AdaCos only, replicated); the margin's EMAs (fp32, replicated: AdaFace's
    ``margin.batch_mean``, ``margin.batch_std``, CurricularFace's ``margin.t``).

    After each forward ``stats`` maps ``scale``, ``theta_med`` (rad), ``b_avg``, ``loss``,
    ``cos_target_mean``, ``cos_nontarget_mean`` and the margin's and auxiliary losses' own
    (``metric_names.MARGIN_STATS``) to floats identical on all ranks, read from the device
    at the first access. ``sampled_index`` holds the local rows the last
    forward used (``None`` = all). ``rows = pop_sampled_rows()``, once per step (a skipped
    one too), is what the ``partial_fc.optim`` optimizers update: ``head_opt.step(rows)``.
    Inputs are never modified.
    """

    def __init__(
        self,
        embedding_size: int,
        num_classes: int,
        margin: Margin,
        sample_rate: float = 1.0,
        process_group: dist_ops.ProcessGroup = None,
        seed: int = 0,
        kernel: str = "auto",
        max_tile_bytes: int = 32 << 20,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init: str = "per_class",
        loss_cap: float | None = None,
        subcenters: int = 1,
        aux_losses: AuxLosses | None = None,
        grad_filter: bool = False,
    ) -> None:
        super().__init__()
        world, rank = dist_ops.get_world_size(process_group), dist_ops.get_rank(process_group)
        check_head_args(embedding_size, num_classes, world, margin, sample_rate, seed, kernel,
                        max_tile_bytes, state_dtype, init, loss_cap, subcenters)
        self.kernel, self.max_tile_bytes = kernel, int(max_tile_bytes)
        self.embedding_size, self.num_classes = embedding_size, num_classes
        self.sample_rate, self.process_group, self.seed = sample_rate, process_group, seed
        self.world_size, self.rank = world, rank
        self.class_start, stop = split_evenly(num_classes, world, rank)
        self.num_local = stop - self.class_start
        self.loss_cap, self.grad_filter = loss_cap, bool(grad_filter)
        self.subcenters = k = subcenters
        weight = torch.empty(k * self.num_local, embedding_size, dtype=state_dtype,
                             device=device)  # a class's K rows drawn as one row of K * D
        # per_rank: every rank draws the rows rank 0 would (its block is their prefix).
        first = self.class_start if init == "per_class" else 0
        init_rows_(weight.view(self.num_local, k * embedding_size), first, seed)
        self.weight = nn.Parameter(weight)  # bf16: the fp32 draws rounded to nearest
        self.tiles = CheckedTiles(kernel, self.max_tile_bytes, k)  # the back-end per device
        self._dominant = DominantShare(self.num_local, k, weight.device) if k > 1 else None
        self.margin = margin
        self.aux_losses = aux_losses or AuxLosses()
        margin.scale.reset(num_classes)
        self.step = 0  # training forwards (or begin_step steps) so far; "step" in state_dict
        self.register_state_dict_post_hook(_save_step)
        self.register_load_state_dict_pre_hook(_load_step)
        self.stats: Mapping[str, float] = {}
        self._plan: StepSample | None = None  # from begin_step, until the next pop
        self._draws = 0  # training forwards of the planned step so far (margin draws)
        self.sampled_index: Tensor | None = None  # rows used by the last forward; None = all
        self._ledger = RowLedger(k * self.num_local, sample_rate)

    @property
    def row_start(self) -> int:
        """The global index of this rank's first weight row (``K`` rows per class)."""
        return self.class_start * self.subcenters

    def take_notes(self) -> list[str]:
        """One line for each choice of the head's a user should see (the torch path for
        sub-centers, a failed kernel check), each once; the trainer logs them."""
        return self.tiles.take_notes()

    def extra_repr(self) -> str:
        return (f"embedding_size={self.embedding_size}, num_classes={self.num_classes}, "
                f"class_start={self.class_start}, num_local={self.num_local}, "
                f"sample_rate={self.sample_rate}"
                + (f", subcenters={self.subcenters}" if self.subcenters > 1 else ""))

    def pop_sampled_rows(self) -> SampledRows:
        """The rows the forwards (with grad enabled) since the last call used, for
        ``head_opt.step(rows)``. Call it
        once per step, also a skipped one (then drop the value): once a loop has popped, a
        forward that finds rows pending whose gradient was cleared raises, since those rows
        would be updated with the next step. After one forward ``rows.index`` is the
        sampler's own index (no copy)."""
        self._plan = None
        return self._ledger.pop(self.weight)

    def begin_step(self, labels: Tensor, sizes: Sequence[int] | None = None,
                   embeddings: Tensor | None = None) -> None:
        """Announce the labels of all micro-batches of the coming optimisation step
        (``[k * n_local]``, this rank's, concatenated; ``sizes`` as in ``forward``), for
        gradient accumulation; collective (one all-gather of the labels).

        The training forwards until the next :meth:`pop_sampled_rows` then share one class
        sample, drawn from the union as for one batch (all positives plus the same random
        negatives, arXiv:2203.15565 Sec. 3), and one ``step`` value (sampler seed, SphereFace's
        lambda, margin warm-up), advanced once for the step: k accumulated micro-batches give
        exactly the loss and gradients of their union in one batch. Without it each forward
        samples for its own labels and advances ``step``. The forwards' labels must be among
        the announced ones; their count is checked (no device read), their values are not.

        ``embeddings`` (``[k * n_local, D]``, the same rows as ``labels``, detached: a
        forward of the backbone without grad) also takes the step's statistics over all its
        samples before any forward uses them: a dynamic AdaCos scale ``s_t`` from ``B_avg``
        (at ``s_{t-1}``) and ``theta_med`` of the whole step, the margin's EMAs moved once by
        the whole step's statistic; the forwards then leave both as they are. The step then
        equals one forward of its union in every statistic, however it is split into
        micro-batches and ranks (DESIGN.md invariants 3 and 9)."""
        if self._ledger.forwards:
            raise RuntimeError("PartialFC: begin_step after a forward whose rows were not "
                               "popped; call head.pop_sampled_rows() to end the previous step")
        sizes = [int(k) for k in sizes] if sizes is not None else \
            dist_ops.gather_sizes(labels.shape[0], labels.device, self.process_group)
        y = dist_ops.all_gather(labels.to(dtype=torch.int64), self.process_group, sizes)
        step = self.step
        index = None
        if self.training and self.sample_rate < 1.0:
            index, _ = sample_classes(y, self.class_start, self.num_local, self.sample_rate,
                                      self.seed, step, self.rank)
        statistics = None
        if embeddings is not None and self.training:
            statistics = self._take_step_statistics(embeddings, y, sizes, index, step)
        self._plan = StepSample(index=index, step=step, samples=sum(sizes),
                                statistics=statistics)
        self._draws = 0
        if self.training:
            self.step += 1

    def _take_step_statistics(self, embeddings: Tensor, y: Tensor, sizes: list[int],
                              index: Tensor | None, step: int) -> GlobalStats:
        """The statistics a training forward moves, over the whole step (``begin_step``):
        the same calls as :meth:`forward` makes before its loss, on the step's gathered
        embeddings ``[N_step, D]`` and labels ``y``; collective. Returns them: the forwards'
        ``stats`` report the step's ``theta_med`` and ``B_avg``. Call it under the autocast
        the forwards run under (their matmul operands' dtype, :meth:`_shard`)."""
        e, norms = self._gather(embeddings.detach().float(), sizes)
        targets = local_targets(y, self.class_start, self.num_local)
        if index is not None:
            targets = columns_in(index, targets)
        with torch.no_grad():
            shard = self._shard(e, expand_rows(index, self.subcenters), targets)
            scale = self.margin.scale
            row_max, row_sum, cos_sum = shard.stats(scale.value())
            glob = global_stats(shard, row_max, row_sum, cos_sum, scale, self.num_classes,
                                True, self.process_group)
            start = sum(sizes[:self.rank])
            self.margin.prepare(MarginBatch(glob.target_cos, norms,
                                            slice(start, start + sizes[self.rank]), step, 0,
                                            True))
        return glob

    def angle_sample(self, embeddings: Tensor, labels: Tensor, per_rank: int = 2048
                     ) -> dict[str, Tensor]:
        """Target and non-target angles (degrees) of the global batch, for histograms:
        ``partial_fc.angles.angle_sample`` on this rank's rows, seeded by ``(seed, step,
        rank)``; collective."""
        return angle_sample(embeddings, labels, self.weight, self.class_start, self.subcenters,
                            derive_seed(self.seed, self.step, self.rank), self.process_group,
                            per_rank)

    def forward(self, embeddings: Tensor, labels: Tensor, sizes: Sequence[int] | None = None,
                trusted_labels: bool = False) -> Tensor:
        """The loss of the global batch (see the class docstring); collective.

        ``sizes``: every rank's ``n_local`` in rank order, when the caller knows them (the
        trainer's equal per-rank batches): the inputs are then checked against them on this
        rank alone and the metadata all-gather, which the host must read, is skipped. A rank
        whose inputs do not match raises alone (the others wait in the next collective until
        the process group's timeout), so pass ``sizes`` only where a mismatch is a bug.
        ``trusted_labels``: the caller vouches that every label lies in ``[0, num_classes)``,
        and the range check, which reads the host, is skipped. Without the check a label out
        of range is no error but a wrong loss (no rank owns its class, so its row has no
        target logit): pass it only for labels from a source that refuses the others before
        they get here, as the trainer's loaders do (``data_pipeline.EpochBatches.num_classes``,
        held equal to ``num_classes`` by ``trainer.build.build``).
        With both, a training-mode forward at ``sample_rate == 1`` reads nothing from the
        device, and so does one at ``r < 1`` whose ``ceil(r * num_local)`` is at least the
        global batch; a smaller sample reads its number of positives (the sample's size)."""
        group = self.process_group
        self._ledger.before_forward(self.weight)
        sizes = check_inputs(embeddings, labels, sizes, self.embedding_size, self.world_size,
                             self.rank, group)
        labels = labels.to(device=embeddings.device, dtype=torch.int64)
        e, norms = self._gather(embeddings.float(), sizes)  # [N, D], [N] or None
        y = dist_ops.all_gather(labels, group, sizes)  # [N]
        if not trusted_labels:
            check_label_range(y, self.num_classes)
        plan = self._plan if self.training else None
        if plan is not None:
            step, index, targets = plan.step, plan.index, plan.take(y, self.class_start,
                                                                   self.num_local)
        elif self.training and self.sample_rate < 1.0:
            step = self.step
            index, targets = sample_classes(y, self.class_start, self.num_local,
                                            self.sample_rate, self.seed, step, self.rank)
        else:
            step = self.step
            index, targets = None, local_targets(y, self.class_start, self.num_local)
        rows = expand_rows(index, self.subcenters)  # a sampled class brings its K rows
        self.sampled_index = rows
        self._ledger.record(rows)
        shard = self._shard(e, rows, targets)
        scale = self.margin.scale
        # the target transform runs outside the tiles: the check feeds them the plain cosine
        shard.tiles = self.tiles.checked(shard.tiles, shard.e, shard.w, shard.inv_norm,
                                         shard.targets, scale.value(), lambda c: c, group)
        row_max, row_sum, cos_sum = shard.stats(scale.value())  # s_{t-1} for dynamic AdaCos
        taken = plan.statistics if plan is not None else None  # begin_step's, of the step
        moves = self.training and taken is None
        glob = global_stats(shard, row_max, row_sum, cos_sum, scale, self.num_classes,
                            moves, group)
        s = scale.value()  # s_t, after a dynamic AdaCos update
        s = s.clone() if isinstance(s, Tensor) else s  # saved for backward: keep it immutable
        start = sum(sizes[:self.rank])
        batch = MarginBatch(glob.target_cos, norms, slice(start, start + sizes[self.rank]),
                            step, self._draws if plan is not None else 0, moves)
        terms = step_terms(self.margin, self.aux_losses, batch, glob, shard, e, y,
                           chunk_columns(e.shape[0], self.max_tile_bytes), group)
        if terms.nontarget is not None:  # other kernel variants, checked on their first use
            shard.tiles = self.tiles.checked(shard.tiles, shard.e, shard.w, shard.inv_norm,
                                             shard.targets, s, lambda c: c, group,
                                             terms.nontarget)
        shard.nontarget = terms.nontarget
        if glob.log_b_avg is not None or terms.nontarget is not None:  # the logits moved:
            row_max, row_sum, _ = shard.stats(s)  # the statistics at s_t, of f(cos)
        loss, sum_exp, shift = margin_softmax_loss(
            e, self.weight, shard, row_max, row_sum, terms.target, s, group, terms.row_term,
            self.loss_cap)
        loss = finish(loss, terms, glob, group)
        if self.training and plan is None:  # a planned step advanced it in begin_step
            self.step += 1
        elif self.training:
            self._draws += 1
        extra = dict(terms.stats) if self._dominant is None else {**terms.stats,
            SUBCENTER_SHARE: self._dominant.update(targets, shard.nearest, index, group)}
        self.stats = stats_readout(loss, glob if taken is None else taken,
                                   sum_exp * glob.neg_ratio, shift, s, extra)
        return loss

    # ------------------------------------------------------------------ helpers

    def _shard(self, e: Tensor, index: Tensor | None, targets: Tensor) -> Shard:
        """This step's rows, their inverse norms (fp32; as ``F.normalize``: norms below 1e-12
        count as 1e-12) and the tile functions. The operand ``e`` (the matmuls' operands; the
        softmax stays fp32) is in the weight's dtype when that is bf16, else in autocast's
        dtype when autocast is on, else fp32: so the target cosines (``Shard.cos_t``) see the
        same rounded embeddings as the tiles, and a bf16 head equals an fp32 head holding the
        same (bf16-valued) rows under bf16 autocast."""
        with torch.no_grad():
            w = self.weight.detach() if index is None else self.weight.detach()[index]
            inv = 1.0 / w.float().norm(dim=1).clamp_min(1e-12)
            e_op, device = e.detach(), e.device.type
            if self.weight.dtype != torch.float32:
                e_op = e_op.to(self.weight.dtype)
            elif torch.is_autocast_enabled(device):
                e_op = e_op.to(torch.get_autocast_dtype(device))
            return Shard(e_op, w, index, inv, targets, self.tiles.for_device(e.device),
                         self.subcenters,
                         skip_classes=self.num_classes if self.grad_filter else None)

    def _gather(self, x: Tensor, sizes: list[int]) -> tuple[Tensor, Tensor | None]:
        """The global batch's normalised embeddings ``[N, D]`` and, when the margin reads
        them, the norms ``||x_i||`` ``[N]`` before normalisation: one all-gather either way
        (differentiable: MagFace's margin passes a gradient to the norms)."""
        if not self.margin.needs_norms:
            return dist_ops.all_gather(F.normalize(x, dim=1), self.process_group, sizes), None
        packed = torch.cat([F.normalize(x, dim=1), x.norm(dim=1, keepdim=True)], dim=1)
        packed = dist_ops.all_gather(packed, self.process_group, sizes)
        return packed[:, :-1].contiguous(), packed[:, -1]


def _save_step(head: PartialFC, state: dict, prefix: str, _metadata) -> None:
    """``state_dict`` post hook: ``step`` as an int64 tensor, where a buffer would be."""
    state[prefix + "step"] = torch.tensor(head.step, dtype=torch.int64)


def _load_step(head: PartialFC, state: dict, prefix: str, _metadata, strict: bool,
               missing: list, _unexpected: list, _errors: list) -> None:
    """``load_state_dict`` pre hook: take ``step`` out of ``state`` into ``head.step``."""
    value = state.pop(prefix + "step", None)
    if value is not None:
        head.step = int(value)
    elif strict:
        missing.append(prefix + "step")
