"""partial-fc: sharded cosine-margin softmax heads for million-class face recognition."""

from partial_fc.head import PartialFC
from partial_fc.margins import build_margin
from partial_fc.optim import SampledAdamW, SampledSGD

__all__ = ["PartialFC", "SampledAdamW", "SampledSGD", "build_margin"]
