"""Embedding distillation losses over the global batch, exact under data parallelism.

A student's embeddings ``s`` (``[n_local, D_s]``, this rank's rows) are pulled towards a
frozen teacher's ``t`` (``[n_local, D_t]``, the same images). Every loss here is a mean over
the **global** batch (``N = sum_r n_r``) and returns the same value on every rank, with the
gradient of that global loss in ``s.grad`` on each rank (the head's contract,
``partial_fc.head``): each rank computes its partial term, :func:`all_reduce` sums them
(backward: identity), and what needs other ranks' rows goes through :func:`all_gather`
(backward: reduce-scatter). A P-rank batch of B therefore gives the 1-process loss and
gradients of the same B (tests/partial_fc/test_distill.py).

Losses (``kind``):

- ``cosine``: ``mean_i (1 - cos(s_i, t_i))``, the feature-level term of face-embedding KD:
  the direction is what verification compares; needs ``D_s == D_t``.
- ``l2``: ``mean_i ||s_i - t_i||^2``, on the raw (un-normalised) embeddings (FitNets-style
  regression, Romero et al., arXiv:1412.6550, Eq. 2 without a regressor); needs ``D_s == D_t``.
- ``similarity``: relational; ``(1/N^2) sum_ij (cos(s_i, s_j) - cos(t_i, t_j))^2``, the
  squared Frobenius distance of the global batch's cosine-similarity matrices
  (Similarity-Preserving KD, Tung & Mori, arXiv:1907.09682, Eq. 2-4, with cosine Gram
  matrices in place of the row-normalised activation Gram). It compares pairs, not
  coordinates, so ``D_s`` may differ from ``D_t``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from partial_fc.distributed import all_gather, all_reduce, get_rank

DISTILL_LOSSES = ("cosine", "l2", "similarity")
COSINE_QUANTILES = (0.05, 0.5, 0.95)  # the student-teacher cosine's percentiles reported


def distill_loss(kind: str, student: Tensor, teacher: Tensor, sizes: Sequence[int],
                 process_group=None) -> Tensor:
    """The global-batch distillation loss ``kind`` (module docstring); collective.

    Args:
        student: ``[n_local, D_s]`` this rank's student embeddings (fp32; differentiable).
        teacher: ``[n_local, D_t]`` the teacher's embeddings of the same images (no grad).
        sizes: every rank's ``n_local`` in rank order (the global batch is their sum).
    Returns:
        A 0-d tensor, the same on every rank.
    """
    if kind not in DISTILL_LOSSES:
        raise ValueError(f"distill loss {kind!r}: expected one of {', '.join(DISTILL_LOSSES)}")
    if student.shape[0] != teacher.shape[0]:
        raise ValueError(f"{student.shape[0]} student rows but {teacher.shape[0]} teacher rows")
    teacher = teacher.detach().to(student.dtype)
    total = sum(sizes)
    if kind == "similarity":
        partial = _similarity_rows(student, teacher, sizes, process_group) / total ** 2
    elif kind == "cosine":
        partial = (1.0 - F.cosine_similarity(student, teacher, dim=1)).sum() / total
    else:
        partial = (student - teacher).pow(2).sum() / total
    return all_reduce(partial, process_group)


def _similarity_rows(student: Tensor, teacher: Tensor, sizes: Sequence[int],
                     process_group) -> Tensor:
    """``sum over this rank's rows i, all j`` of ``(cos(s_i, s_j) - cos(t_i, t_j))^2``: the
    ranks' row blocks partition the ``N x N`` matrices, so the sum over ranks is the whole."""
    s_all = F.normalize(all_gather(student, process_group, sizes), dim=1)  # [N, D_s]
    t_all = F.normalize(all_gather(teacher, process_group, sizes), dim=1)  # [N, D_t]
    start = sum(sizes[:get_rank(process_group)])
    rows = slice(start, start + student.shape[0])
    return (s_all[rows] @ s_all.T - t_all[rows] @ t_all.T).pow(2).sum()


@torch.no_grad()
def cosine_summary(student: Tensor, teacher: Tensor, sizes: Sequence[int],
                   process_group=None) -> dict[str, Tensor]:
    """The student-teacher cosine of every sample of the global batch, summarised: ``mean``
    and the :data:`COSINE_QUANTILES` (``p5``, ``p50``, ``p95``); device tensors, the same on
    every rank; collective. ``D_s != D_t`` has no such cosine: ``{}``."""
    if student.shape[1] != teacher.shape[1]:
        return {}
    cos = all_gather(F.cosine_similarity(student.detach(), teacher.to(student.dtype), dim=1),
                     process_group, sizes)
    q = torch.quantile(cos, torch.tensor(COSINE_QUANTILES, dtype=cos.dtype, device=cos.device))
    return {"mean": cos.mean(), **{f"p{round(100 * p)}": v for p, v in zip(COSINE_QUANTILES, q,
                                                                          strict=True)}}
