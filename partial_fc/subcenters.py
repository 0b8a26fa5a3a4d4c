"""Sub-center ArcFace (Deng et al., ECCV 2020, "Sub-center ArcFace: Boosting Face Recognition
by Large-scale Noisy Web Faces", Sec. 3.1): ``K`` centres per class, and the class's cosine is
the largest of its ``K``: ``cos theta_ij = max_k cos(x_i, W_jk)``; any margin then acts on that
cosine as on a plain one.

Layout: class-major rows, ``weight[j * K + k]`` the ``k``-th centre of local class ``j``. A
rank's ``K * num_local`` rows are then one contiguous block of the global ``[K * C, D]``
matrix, in class order, so a checkpoint resharded over another rank count by row blocks
(``K * class_start`` on) keeps every class's ``K`` rows together on the class's own shard,
and the max never crosses ranks (no collective beyond a plain head's).

Gradient: ``max`` routes a class's ``dL/dcos`` to its argmax centre only (the derivative of
``max``; the other ``K - 1`` centres of that class get 0 from that sample), as the paper's
max pooling does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from partial_fc import distributed as dist_ops

__all__ = ["DominantShare", "best_of", "expand_rows", "spread"]


def expand_rows(index: Tensor | None, k: int) -> Tensor | None:
    """Sorted class rows ``index`` ``[S]`` (``None`` = all) -> their weight rows ``[S * K]``,
    sorted: ``index_j * K + 0 .. K - 1``."""
    if index is None or k == 1:
        return index
    return (index[:, None] * k + torch.arange(k, device=index.device)).flatten()


def best_of(cos_rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``[N, S * K]`` centre cosines -> ``(cos [N, S], arg [N, S])``: each class's largest
    cosine and which of its ``K`` centres gave it (ties: the first)."""
    n, cols = cos_rows.shape
    return cos_rows.view(n, cols // k, k).max(dim=2)


def spread(g: Tensor, arg: Tensor, k: int) -> Tensor:
    """``dL/dcos`` of the classes ``[N, S]`` -> of the centres ``[N, S * K]``: all on each
    class's argmax centre ``arg``, 0 on the others (the derivative of ``max``)."""
    n, cols = g.shape
    out = torch.zeros(n, cols, k, dtype=g.dtype, device=g.device)
    return out.scatter_(2, arg[:, :, None], g[:, :, None]).view(n, cols * k)


class DominantShare:
    """The dominant-center share: of the samples seen since this head was built, the share
    closest to their class's dominant centre (the one most of the class's samples were
    closest to). The paper's cleaning keeps the dominant centre and drops the samples far
    from it (Sec. 3.2); a share near 1 means the classes are mostly clean.

    Per-class counts ``[num_local, K]`` (int64, on the weight's device, not in the state_dict:
    a resumed run counts again from its first step). ``update`` adds each owned sample of the
    global batch to its nearest centre and returns the share, summed over the ranks (one
    all-reduce of two numbers, sub-center heads only); nothing is read by the host."""

    def __init__(self, num_local: int, k: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_local, k, dtype=torch.int64, device=device)

    @torch.no_grad()
    def update(self, targets: Tensor, nearest: Tensor, class_rows: Tensor | None,
               group: dist_ops.ProcessGroup) -> Tensor:
        """``targets`` ``[N]``: each sample's class column in the step's (sampled) classes,
        ``-1`` where another rank owns it; ``nearest`` ``[N]``: the centre (``0 .. K - 1``)
        nearest to each owned sample; ``class_rows``: the sampled local classes (``None`` =
        all). Returns the share over all ranks' counts (0-d fp64)."""
        if self.counts.device != targets.device:
            self.counts = self.counts.to(targets.device)
        owned = targets >= 0
        cls = targets.clamp_min(0)
        if class_rows is not None:
            cls = class_rows[cls]
        flat = self.counts.view(-1)
        flat.index_add_(0, cls * self.counts.shape[1] + nearest, owned.to(torch.int64))
        totals = torch.stack([self.counts.amax(dim=1).sum(), self.counts.sum()]).double()
        top, seen = dist_ops.all_reduce(totals, group)
        return top / seen.clamp_min(1.0)
