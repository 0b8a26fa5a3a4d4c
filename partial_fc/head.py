"""PartialFC: the class-sharded cosine-margin softmax head (arXiv:2203.15565).

Data flow of one forward, on every rank of ``process_group`` (see ``distributed`` for the
gradient convention)::

    e_local [n_r, D] --normalise--> all_gather --> E [N, D]      (labels likewise -> Y [N])
    sample local classes (training, r < 1)   -> W_s [S_r, D] rows of this rank's shard
    cos = E @ normalise(W_s)^T  [N, S_r]     (autocast may run this matmul in bf16/fp16)
    no-grad all-reduce of global statistics  -> AdaCos s_t, stats   (fp32 row sums, fp64 reduce)
    partial_fc.softmax (one autograd Function, hand-written backward), fp32:
      logits: s * cos, target entries this rank owns -> s * psi(cos_target)
      max: all-reduce MAX (detached); sum-exp and shifted target logit: all-reduce SUM
      loss = mean_i [ log(sum_k exp(z_ik - m_i)) - (z_iy - m_i) ]   identical on all ranks

The result equals ``F.cross_entropy`` on the full ``[N, C]`` logits of one process: the
embedding gradient is exactly ``dL/de_local`` and each rank's ``weight.grad`` holds exactly
its rows of ``dL/dW`` (zero for unsampled rows). Nothing is scaled by the world size;
compensating data-parallel gradient averaging of the backbone is the engine's job.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partial_fc import distributed as dist_ops
from partial_fc.init import derive_seed, init_rows_
from partial_fc.margins import Margin
from partial_fc.sampling import local_targets, sample_classes
from partial_fc.scale import AdaCosScale, log_mean_exp, median_angle
from partial_fc.softmax import margin_softmax_loss

__all__ = ["PartialFC"]


class PartialFC(nn.Module):
    """Class-sharded margin softmax head.

    Args:
        embedding_size: ``D``.
        num_classes: ``C``, split contiguously over the ranks of ``process_group``.
        margin: from ``partial_fc.build_margin``; owns the scale (fixed or AdaCos).
        sample_rate: ``r in (0, 1]``; in training each rank keeps every positive of the
            global batch plus random negatives, ``max(ceil(r * num_local), #positives)`` rows.
        process_group: ``None`` = WORLD, resolved when called; no initialised process group
            = one rank (no collectives at all).
        seed: seeds the weight init (per global class) and the negative sampling.

    ``forward(embeddings [n_local, D], labels [n_local] int64) -> loss`` (0-d fp32): the mean
    loss of the **global** batch, identical on all ranks. Ranks may pass different ``n_local``.

    State (``state_dict``): ``weight`` ``[num_local, D]`` (this rank's rows, classes
    ``class_start ..``); ``step`` (int64, replicated: training-mode forwards so far, seeds
    the sampler and SphereFace's lambda); ``margin.scale.s`` (fp32, replicated; AdaCos only).

    After each forward ``stats`` holds floats identical on all ranks: ``scale``, ``theta_med``
    (median target angle, rad), ``b_avg`` (AdaCos ``B_avg``: with the previous scale when a
    dynamic AdaCos step updated ``s``, else with the current one; estimated from sampled
    negatives), ``loss``, ``cos_target_mean``, ``cos_nontarget_mean`` (over sampled classes).
    ``sampled_index`` holds the local rows the last forward used (``None`` = all rows);
    ``pop_sampled_rows()`` is how ``partial_fc.optim`` learns which rows to update.

    Memory: at most two fp32 ``[N, S]`` buffers are alive at once: in forward the cosines
    (the matmul's output, freed when ``forward`` returns) and one other, first dynamic
    AdaCos's ``exp(s (cos - 1))`` (freed once summed), then the logits, which
    ``partial_fc.softmax.margin_softmax_loss`` turns in place into the probabilities, the only
    ``[N, S]`` buffer kept for backward; its backward turns it in place into ``dL/dcos``,
    consumed by the matmul's backward. Inputs are never modified.
    """

    def __init__(
        self,
        embedding_size: int,
        num_classes: int,
        margin: Margin,
        sample_rate: float = 1.0,
        process_group: dist_ops.ProcessGroup = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        world, rank = dist_ops.get_world_size(process_group), dist_ops.get_rank(process_group)
        if embedding_size < 1:
            raise ValueError(f"PartialFC: embedding_size={embedding_size} must be >= 1")
        if num_classes < world:
            raise ValueError(
                f"PartialFC: num_classes={num_classes} < world size {world}: every rank needs "
                "at least one class"
            )
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"PartialFC: sample_rate={sample_rate} must be in (0, 1]")
        if not isinstance(margin, Margin):
            raise TypeError(f"PartialFC: margin must come from build_margin, got {margin!r}")
        if seed < 0:
            raise ValueError(f"PartialFC: seed={seed} must be >= 0")
        self.embedding_size, self.num_classes = embedding_size, num_classes
        self.sample_rate, self.process_group, self.seed = sample_rate, process_group, seed
        self.world_size, self.rank = world, rank
        self.class_start, stop = dist_ops.split_evenly(num_classes, world, rank)
        self.num_local = stop - self.class_start
        self.weight = nn.Parameter(init_rows_(
            torch.empty(self.num_local, embedding_size), self.class_start, seed))
        self.margin = margin
        margin.scale.reset(num_classes)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.stats: dict[str, float] = {}
        self.sampled_index: Tensor | None = None  # rows used by the last forward; None = all
        self._pending_rows: Tensor | None = None  # bool [num_local]: rows used since last pop

    def extra_repr(self) -> str:
        return (f"embedding_size={self.embedding_size}, num_classes={self.num_classes}, "
                f"class_start={self.class_start}, num_local={self.num_local}, "
                f"sample_rate={self.sample_rate}")

    def pop_sampled_rows(self) -> Tensor | None:
        """Sorted local rows used by the forwards (with grad enabled) since the last call, for
        the ``partial_fc.optim`` optimizers. ``None`` means all rows (always so when
        ``sample_rate == 1``); an empty tensor means no forward happened."""
        rows, self._pending_rows = self._pending_rows, None
        if self.sample_rate == 1.0:
            return None
        if rows is None:
            return torch.zeros(0, dtype=torch.int64, device=self.weight.device)
        return None if bool(rows.all()) else rows.nonzero().squeeze(1)

    @torch.no_grad()
    def angle_sample(self, embeddings: Tensor, labels: Tensor, per_rank: int = 2048
                     ) -> dict[str, Tensor]:
        """Target and non-target angles (degrees) of the global batch, for histograms (as
        AdaCos Fig. 1). Collective: every rank passes its local batch and gets the gathered
        ``{"theta_target": [N], "theta_nontarget": [<= P * per_rank]}``, the same on all ranks.

        Each rank measures the targets it owns and ``per_rank`` (sample, own class) pairs drawn
        uniformly with replacement, targets among them dropped, seeded by ``(seed, step,
        rank)``; only those rows are normalised, so the cost is ``O((N + per_rank) D)``, not
        a full ``[N, num_local]`` product. Diagnostics only: no loss, gradient, step or
        sampler state is touched."""
        group, device = self.process_group, embeddings.device
        sizes = dist_ops.gather_sizes(embeddings.shape[0], device, group)
        e = dist_ops.all_gather(F.normalize(embeddings.float(), dim=1), group, sizes)
        y = dist_ops.all_gather(labels.to(device=device, dtype=torch.int64), group, sizes)
        targets = local_targets(y, self.class_start, self.num_local)
        owned = (targets >= 0).nonzero().squeeze(1)
        gen = torch.Generator(device=device).manual_seed(
            derive_seed(self.seed, int(self.step), self.rank))
        pick_i = torch.randint(len(y), (per_rank,), generator=gen, device=device)
        pick_k = torch.randint(self.num_local, (per_rank,), generator=gen, device=device)
        keep = pick_k != targets[pick_i]
        pick_i, pick_k = pick_i[keep], pick_k[keep]
        out = {}
        for name, i, k in (("theta_target", owned, targets[owned]),
                           ("theta_nontarget", pick_i, pick_k)):
            w = F.normalize(self.weight.detach()[k].float(), dim=1)
            cos = (e[i] * w).sum(dim=1).clamp(-1.0, 1.0)
            out[name] = torch.rad2deg(torch.acos(dist_ops.all_gather(cos, group)))
        return out

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        group = self.process_group
        sizes = self._check_inputs(embeddings, labels)
        labels = labels.to(device=embeddings.device, dtype=torch.int64)
        e = dist_ops.all_gather(F.normalize(embeddings.float(), dim=1), group, sizes)  # [N, D]
        y = dist_ops.all_gather(labels, group, sizes)  # [N]
        bad = (y < 0) | (y >= self.num_classes)
        if bool(bad.any()):  # every rank sees the same gathered labels: all raise together
            raise ValueError(f"PartialFC: label {int(y[bad][0])} out of range "
                             f"[0, {self.num_classes}) (num_classes={self.num_classes})")
        step = int(self.step)
        if self.training and self.sample_rate < 1.0:
            index, targets = sample_classes(y, self.class_start, self.num_local,
                                            self.sample_rate, self.seed, step, self.rank)
        else:
            index, targets = None, local_targets(y, self.class_start, self.num_local)
        self._record_rows(index)
        weight = self.weight if index is None else self.weight[index]
        cos = (e @ F.normalize(weight, dim=1).t()).float()  # [N, S]
        rows = (targets >= 0).nonzero().squeeze(1)
        cols = targets[rows]
        cos_t = cos.detach()[rows, cols]  # [n_owned]: targets this rank owns
        glob = self._global_stats(cos, rows, cols, cos_t)
        s = self.margin.scale.value()  # s_t, after a dynamic AdaCos update
        s = s.clone() if isinstance(s, Tensor) else s  # saved for backward: keep it immutable
        loss, sum_exp, shift = margin_softmax_loss(
            cos, rows, cols, functools.partial(self.margin.psi, step=step), s, group)
        if self.training:
            self.step += 1
        self._set_stats(loss, glob, sum_exp * glob["neg_ratio"], shift, s)
        return loss

    # ------------------------------------------------------------------ helpers

    def _check_inputs(self, embeddings: Tensor, labels: Tensor) -> list[int]:
        """Validate shapes on every rank at once (one small all-gather), so a bad rank makes
        all ranks raise instead of leaving the others blocked in a collective."""
        world = dist_ops.get_world_size(self.process_group)
        if world != self.world_size:
            raise RuntimeError(f"PartialFC: built for world size {self.world_size}, "
                               f"called with {world}")
        ok = (embeddings.dim() == 2 and embeddings.shape[-1] == self.embedding_size
              and embeddings.is_floating_point() and labels.dim() == 1
              and labels.shape[0] == embeddings.shape[0] and not labels.is_floating_point()
              and not labels.is_complex() and labels.dtype != torch.bool)
        n = embeddings.shape[0] if embeddings.dim() else 0
        meta = dist_ops.gather_ints([n, int(ok)], embeddings.device,
                              self.process_group)
        if not bool(meta[:, 1].all()):
            culprit = int((meta[:, 1] == 0).nonzero()[0, 0])
            raise ValueError(
                f"PartialFC: rank {culprit} passed bad inputs; expected embeddings float "
                f"[n, {self.embedding_size}] and labels int64 [n], this rank got embeddings "
                f"{tuple(embeddings.shape)} {embeddings.dtype}, labels {tuple(labels.shape)} "
                f"{labels.dtype}")
        sizes = meta[:, 0].tolist()
        if sum(sizes) == 0:
            raise ValueError("PartialFC: the global batch is empty")
        return sizes

    def _record_rows(self, index: Tensor | None) -> None:
        self.sampled_index = index
        if self.sample_rate == 1.0 or not torch.is_grad_enabled():
            return
        if self._pending_rows is None:
            self._pending_rows = torch.zeros(self.num_local, dtype=torch.bool,
                                             device=self.weight.device)
        if index is None:
            self._pending_rows.fill_(True)
        else:
            self._pending_rows[index] = True

    @torch.no_grad()
    def _global_stats(self, cos: Tensor, rows: Tensor, cols: Tensor, cos_t: Tensor) -> dict:
        """One all-reduce (fp64) of: each sample's target cos, each sample's partial
        ``sum_{k != y} exp(s_prev (cos_k - 1))`` (dynamic AdaCos only), the number of sampled
        classes and the sum of non-target cosines. Updates a dynamic AdaCos scale. Row sums
        over ``[N, S]`` run in fp32 (an fp64 ``sum`` would copy the whole buffer to fp64)."""
        n, sampled = cos.shape
        scale = self.margin.scale
        dynamic = isinstance(scale, AdaCosScale) and scale.dynamic and self.training
        packed = torch.zeros(2 * n + 2, dtype=torch.float64, device=cos.device)
        packed[rows] = cos_t.double()
        if dynamic:  # shift by s_prev * 1 (cos <= 1): no overflow whatever s is
            ex = (cos - 1.0).mul_(scale.value()).exp_()
            ex[rows, cols] = 0.0
            packed[n: 2 * n] = ex.sum(dim=1).double()
            del ex
        packed[2 * n] = sampled
        packed[2 * n + 1] = cos.sum(dim=1).double().sum() - packed[rows].sum()
        packed = dist_ops.all_reduce(packed, self.process_group)
        target_cos, total = packed[:n].float(), int(packed[2 * n])
        neg_ratio = (self.num_classes - 1) / (total - 1) if total > 1 else math.nan
        theta_med = median_angle(target_cos)
        out = {"target_cos": target_cos, "theta_med": theta_med, "neg_ratio": neg_ratio,
               "nontarget_cos_sum": float(packed[2 * n + 1]), "negatives": total - 1,
               "log_b_avg": None}
        if dynamic and total > 1:  # B estimated from the sampled negatives, rescaled
            log_b = scale.value().double() + torch.log(packed[n: 2 * n] * neg_ratio)
            out["log_b_avg"] = log_mean_exp(log_b)
            scale.update(out["log_b_avg"].float(), theta_med)
        return out

    def _set_stats(self, loss: Tensor, glob: dict, b_sums: Tensor, shift: Tensor,
                   s: Tensor | float) -> None:
        """``stats`` from replicated tensors only (so identical on all ranks), one host sync."""
        log_b_avg = glob["log_b_avg"]
        if log_b_avg is None:  # B at the current s, from the softmax's non-target sums
            log_b_avg = log_mean_exp(torch.log(b_sums.double()) + shift.double())
        n = glob["target_cos"].numel()
        neg = glob["negatives"]
        scale = torch.as_tensor(s, dtype=torch.float64, device=loss.device)
        vals = torch.stack([loss.detach().double(), glob["theta_med"].double(),
                            log_b_avg.double(), glob["target_cos"].double().mean(), scale])
        vals = vals.tolist()
        self.stats = {
            "scale": vals[4], "theta_med": vals[1], "b_avg": math.exp(min(vals[2], 709.0)),
            "loss": vals[0], "cos_target_mean": vals[3],
            "cos_nontarget_mean": glob["nontarget_cos_sum"] / (n * neg) if neg else math.nan,
        }
