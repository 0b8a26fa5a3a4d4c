"""Any timm model as a face backbone: ``backbone.name=timm:<model>``.

timm (``pip install 'partial-fc[timm]'``) is imported only when such a name is built. The
model is created with random weights and ``num_classes=0`` (timm then returns its pooled
features ``[N, F]``; ``pretrained=False``, so nothing is downloaded) and, where the model
takes an input size (its ViTs), ``img_size=112`` so that the position embedding fits the
112x112 face crops. On top sits the embedding layer of the native backbones (insightface's):
dropout, ``Linear(F -> D)`` without bias, BatchNorm1d. Weights from a local file are loaded
by the trainer (``backbone.weights``) into :attr:`TimmBackbone.trunk`.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from partial_fc.backbones.norm import BatchNorm1d

PREFIX = "timm:"
IMAGE = 112


class TimmBackbone(nn.Module):
    """``trunk`` (a timm model built with ``num_classes=0``) + the embedding layer.

    Maps float ``[N, 3, 112, 112]`` in [-1, 1] to ``[N, embedding_size]``.
    """

    def __init__(self, trunk: nn.Module, embedding_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.trunk = trunk
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(trunk.num_features, embedding_size, bias=False)
        self.features = BatchNorm1d(embedding_size)

    def no_weight_decay(self) -> set[str]:
        """The trunk's own exclusions (timm models name their position embeddings and
        tokens), under ``trunk.``."""
        names = getattr(self.trunk, "no_weight_decay", set)()
        return {f"trunk.{n}" for n in names}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(self.fc(self.dropout(self.trunk(x))))


def build_timm(name: str, embedding_size: int = 512, dropout: float = 0.0) -> TimmBackbone:
    """Build ``timm:<model>`` (``name`` with its prefix).

    Raises:
        ValueError: timm is not installed or its torchvision does not load, or timm does
            not know the model (the message names it and how to list the valid ones).
    """
    model = name.removeprefix(PREFIX)
    try:
        timm = importlib.import_module("timm")
    except ImportError as exc:
        raise ValueError(f"backbone {name!r} needs timm: pip install 'partial-fc[timm]' "
                         f"({exc})") from None
    except RuntimeError as exc:  # torchvision's import, when its C++ ops do not load
        first = str(exc).strip().splitlines()[0]
        raise ValueError(f"backbone {name!r}: importing timm failed in torchvision ({first}); "
                         f"timm needs the torchvision built for this torch {torch.__version__} "
                         "(a CUDA torchvision wheel does not load beside a CPU torch)") from None
    if not timm.is_model(model):
        raise ValueError(f"backbone {name!r}: timm has no model {model!r} (timm.list_models() "
                         "lists them)")
    try:
        trunk = timm.create_model(model, pretrained=False, num_classes=0, img_size=IMAGE)
    except TypeError:  # a model without an input size (a CNN): any size goes
        trunk = timm.create_model(model, pretrained=False, num_classes=0)
    return TimmBackbone(trunk, embedding_size, dropout)
