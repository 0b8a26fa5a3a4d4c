"""Margins: one file per family, each declaring its types' config keys (defaults, bounds,
descriptions), its target transform and its global statistics; ``registry`` names them and
derives ``build_margin``, the rules and the config schema's ``margin:`` keys from them.

Adding a margin: a file here with its config dataclass (fields made by ``keys.key``), its
:class:`Margin` subclass and a ``MarginSpec``; one line in ``registry.REGISTRY``; its tests
(docs/design.md, "Adding a margin").
"""

from partial_fc.margins.base import Margin
from partial_fc.margins.combined import CombinedMargin
from partial_fc.margins.registry import REGISTRY, build_margin
from partial_fc.margins.sphereface import SphereFaceMargin

__all__ = ["REGISTRY", "CombinedMargin", "Margin", "SphereFaceMargin", "build_margin"]
