"""partial-fc: sharded cosine-margin softmax heads for million-class face recognition."""

from partial_fc.margins import build_margin

__all__ = ["build_margin"]
