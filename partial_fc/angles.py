"""The angle sample behind the training histograms: target and non-target angles of the
global batch against each rank's shard of a ``PartialFC``'s rows (``PartialFC.angle_sample``),
drawn so that no ``[N, num_local]`` product is formed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from partial_fc import distributed as dist_ops
from partial_fc.sampling import local_targets

__all__ = ["angle_sample"]


@torch.no_grad()
def angle_sample(embeddings: Tensor, labels: Tensor, weight: Tensor, class_start: int,
                 subcenters: int, seed: int, process_group: dist_ops.ProcessGroup,
                 per_rank: int = 2048) -> dict[str, Tensor]:
    """Target and non-target angles (degrees) of the global batch, for histograms (as
    AdaCos Fig. 1). Collective: every rank passes its local batch and gets the gathered
    ``{"theta_target": [N], "theta_nontarget": [<= P * per_rank]}``, the same on all ranks.

    Each rank measures the targets it owns and ``per_rank`` (sample, own class) pairs drawn
    uniformly with replacement, targets among them dropped, seeded by ``seed`` (the head's:
    of its seed, step and rank); ``weight`` ``[K * num_local, D]`` is the rank's rows, its
    first class ``class_start``, ``K = subcenters`` rows a class. Only those rows are
    normalised, so the cost is ``O((N + per_rank) D)``, not a full ``[N, num_local]``
    product. Diagnostics only: no loss, gradient, step or sampler state is touched."""
    group, device = process_group, embeddings.device
    num_local = weight.shape[0] // subcenters
    sizes = dist_ops.gather_sizes(embeddings.shape[0], device, group)
    e = dist_ops.all_gather(F.normalize(embeddings.float(), dim=1), group, sizes)
    y = dist_ops.all_gather(labels.to(device=device, dtype=torch.int64), group, sizes)
    targets = local_targets(y, class_start, num_local)
    owned = (targets >= 0).nonzero().squeeze(1)
    gen = torch.Generator(device=device).manual_seed(seed)
    pick_i = torch.randint(len(y), (per_rank,), generator=gen, device=device)
    pick_k = torch.randint(num_local, (per_rank,), generator=gen, device=device)
    keep = pick_k != targets[pick_i]
    pick_i, pick_k = pick_i[keep], pick_k[keep]
    out = {}
    for name, i, k in (("theta_target", owned, targets[owned]),
                       ("theta_nontarget", pick_i, pick_k)):
        rows = k[:, None] * subcenters + torch.arange(subcenters, device=device)
        w = F.normalize(weight.detach()[rows].float(), dim=2)  # [M, K, D]
        cos = (e[i][:, None] * w).sum(dim=2).amax(dim=1).clamp(-1.0, 1.0)
        out[name] = torch.rad2deg(torch.acos(dist_ops.all_gather(cos, group)))
    return out

