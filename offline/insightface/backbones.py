"""insightface arcface_torch's backbone names and state_dict keys, mapped onto ours.

arcface_torch (``recognition/arcface_torch/backbones``) and ``partial_fc.backbones`` build the
same iResNets key for key. Its ViTs differ in three names (``patch_embed.proj`` is our
``patch_embed``, ``mlp.fc1/fc2`` our ``mlp.0/2``) and always hold a ``mask_token``, which ours
create only where the recipe masks tokens (it is unused at inference, so an unmasked ViT drops
it). Its ``mbf`` and ``mbf_large`` are ``partial_fc.backbones.mbf`` (not ``mobilefacenet``, the
paper's narrower network), whose modules are named otherwise: their parameters map position by
position, each shape checked. ``r2060`` is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from partial_fc.backbones import build_backbone
from trainer.errors import Refused

# arcface_torch's ``config.network`` -> ours (its ``get_model`` names).
NETWORKS = {
    "r18": "iresnet18", "r34": "iresnet34", "r50": "iresnet50", "r100": "iresnet100",
    "r200": "iresnet200",
    "vit_t": "vit_t", "vit_t_dp005_mask0": "vit_t", "vit_s": "vit_s",
    "vit_s_dp005_mask_0": "vit_s", "vit_b": "vit_b", "vit_b_dp005_mask_005": "vit_b",
    "vit_l_dp005_mask_005": "vit_l", "vit_h": "vit_h", "mbf": "mbf", "mbf_large": "mbf_large",
}
# Ours are built as its WebFace42M variants (vit_t_dp005_mask0, ...); its plain ViTs train
# with drop_path_rate=0.1 and mask_ratio=0.1 (its get_model), which these keys set.
VIT_OPTIONS = {n: {"drop_path": 0.1, "mask_ratio": 0.1} for n in ("vit_t", "vit_s", "vit_b")}
UNSUPPORTED = {"r2060": "iresnet2060 has no counterpart here"}
POSITIONAL = frozenset({"mbf", "mbf_large"})  # same parameters in the same order, other names
_RENAMES = ((re.compile(r"^patch_embed\.proj\."), "patch_embed."),
            (re.compile(r"\.mlp\.fc1\."), ".mlp.0."), (re.compile(r"\.mlp\.fc2\."), ".mlp.2."))
_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


class ImportRefused(Refused, ValueError):
    """An arcface_torch file that cannot be imported: one line naming it and what is wrong."""

    label = "import error"


def our_network(network: str, where: str) -> str:
    """Our backbone name for arcface_torch's ``network``; refuses the ones we lack."""
    if network in NETWORKS:
        return NETWORKS[network]
    why = UNSUPPORTED.get(network, f"not one of {', '.join(sorted(NETWORKS))}")
    raise ImportRefused(f"{where}: network {network!r} cannot be imported: {why}")


def network_keys(network: str, where: str) -> dict[str, object]:
    """The partial-fc ``backbone.*`` keys (dotted) that build arcface_torch's ``network``."""
    options = VIT_OPTIONS.get(network, {})
    return {"backbone.name": our_network(network, where),
            **{f"backbone.{k}": v for k, v in options.items()}}


def our_key(key: str) -> str:
    """An arcface_torch backbone state_dict key under our module names."""
    for pattern, replacement in _RENAMES:
        key = pattern.sub(replacement, key)
    return key


def is_parameter(key: str) -> bool:
    """Whether an arcface_torch backbone key is a parameter (not a BatchNorm buffer): their
    order is the optimizer's parameter index order."""
    return not key.endswith(_BUFFERS)


def _embedding_size(state: Mapping[str, Tensor]) -> int:
    """``D``: the length of the last 1-D tensor (the feature BatchNorm of every family)."""
    last = [v for v in state.values() if v.ndim == 1 and v.is_floating_point()]
    return int(last[-1].shape[0]) if last else 0


def _shapes(name: str, embedding_size: int, depth: int | None, **vit_options: float
            ) -> dict[str, torch.Size] | None:
    try:
        with torch.device("meta"):  # no memory: shapes only
            model = build_backbone(name, embedding_size=embedding_size, depth=depth,
                                   **vit_options)
    except ValueError:
        return None
    return {k: v.shape for k, v in model.state_dict().items()}


def convert_state(state: Mapping[str, Tensor], where: str, network: str | None = None,
                  ours: str | None = None, depth: int | None = None
                  ) -> tuple[str, int, dict[str, Tensor], dict[str, str]]:
    """``(our backbone name, embedding size, our state_dict, {its key: our key})`` of an
    arcface_torch backbone state_dict read from ``where``. ``network`` (its config's name) or
    ``ours`` (a partial-fc backbone name, with ``depth`` for a ViT) picks the architecture;
    without either, the one whose keys and shapes the file matches exactly is found.

    Raises :class:`ImportRefused` naming ``where`` when no architecture matches (another
    network's state_dict), with the first missing and unexpected keys."""
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ImportRefused(f"{where}: not a state_dict of tensors")
    renamed = {our_key(k): v for k, v in state.items()}
    size = _embedding_size(renamed)
    names = [our_network(network, where)] if network else [ours] if ours \
        else sorted(set(NETWORKS.values()))
    best = None
    for name in names:
        shapes = _shapes(name, size, depth, **VIT_OPTIONS.get(network, {}))
        if shapes is None:
            continue
        mine = {k: v for k, v in renamed.items() if k in shapes or k != "mask_token"}
        keys = {k: our_key(k) for k in state}
        if name in POSITIONAL and [v.shape for v in mine.values()] == list(shapes.values()):
            keys = dict(zip(state, shapes, strict=True))
            mine = dict(zip(shapes, mine.values(), strict=True))
        missing = [k for k in shapes if k not in mine]
        unexpected = [k for k in mine if k not in shapes]
        wrong = [k for k in shapes if k in mine and mine[k].shape != shapes[k]]
        if not (missing or unexpected or wrong):
            return name, size, mine, keys
        score = len(missing) + len(unexpected) + len(wrong)
        if best is None or score < best[0]:
            best = (score, name, missing, unexpected, wrong)
    if best is None:
        raise ImportRefused(f"{where}: no backbone of embedding size {size} to compare with")
    _, name, missing, unexpected, wrong = best
    detail = "; ".join(f"{label} {keys[:3]}{' ...' if len(keys) > 3 else ''}"
                       for label, keys in (("missing", missing), ("unexpected", unexpected),
                                           ("wrong shape", wrong)) if keys)
    what = f"arcface_torch {network!r}" if network else repr(ours) if ours \
        else "any arcface_torch backbone we build"
    raise ImportRefused(f"{where}: not a state_dict of {what} (closest: {name}; {detail})")
