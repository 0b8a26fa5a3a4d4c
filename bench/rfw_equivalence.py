"""Benchmark: RFW as TFace's ``recognition/test/verification_rfw.py`` scores it, next to ours.

    python bench/rfw_equivalence.py --tface DIR     # DIR: a checkout of TFace

Fabricates an RFW folder of four ``<group>_test.bin`` sets from the AT&T/ORL faces (each
"group" ten identities: s1-s10, s11-s20, s21-s30, s31-s40; 450 genuine and 450 impostor
pairs each) and scores one seeded, untrained ``iresnet_tiny`` on it twice:

- TFace: its own ``load_rfw_bin`` (OpenCV decode, its scaling, the flip) and
  ``perform_rfw_val_bin`` / ``rfw_evaluate`` from ``recognition/test/utils.py``, run as
  ``verification_rfw.py``'s ``main`` runs them (the backbone is called on its float input);
  the summary as its last line computes it (``np.std(100 * accuracies, ddof=1)``);
- partial-fc: ``trainer.evaluation.evaluate_rfw_dir`` (``--rfw``'s path), TFace's rule and
  the exact one.

Only what a CPU and this environment need is patched: ``torchvision.transforms`` (imported
by utils.py, unused by these functions) is a stand-in module, and ``rfw_calculate_val``
(VAL@FAR, computed beside the accuracy and never read by verification_rfw.py; its scipy call
fails on today's scipy) returns zeros. Prints per group TFace's and our
accuracy and their difference, then the mean and the standard deviation; asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

from data_pipeline.orl_pairs import write_orl_verification_bin
from partial_fc.backbones import build_backbone
from partial_fc.eval.fairness import RFW_GROUPS
from trainer.evaluation import evaluate_rfw_dir


def _tface_utils(tface: Path):
    """TFace's ``recognition/test/utils.py`` as a module (torchvision stubbed)."""
    path = tface / "recognition" / "test" / "utils.py"
    if not path.is_file():
        raise SystemExit(f"{path}: missing (give a checkout of Tencent/TFace)")
    stub = types.ModuleType("torchvision")
    stub.transforms = types.ModuleType("torchvision.transforms")
    sys.modules.setdefault("torchvision", stub)
    sys.modules.setdefault("torchvision.transforms", stub.transforms)
    spec = importlib.util.spec_from_file_location("tface_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Its VAL@FAR helper feeds scipy's interp1d duplicate FARs, which scipy >= 1.13 refuses;
    # rfw_evaluate computes it beside the accuracy and verification_rfw.py never reads it.
    module.rfw_calculate_val = lambda *args, **kwargs: (0.0, 0.0, 0.0)
    return module


def _tface_rfw(tface: Path, folder: Path, backbone: torch.nn.Module) -> dict[str, float]:
    """verification_rfw.py's loop: per group ``np.max([acc2])``, as its ``main`` takes it."""
    utils = _tface_utils(tface)
    rfw_source = (tface / "recognition" / "test" / "verification_rfw.py").read_text()
    namespace: dict = {"os": __import__("os"), "np": np}
    # Its load_rfw_bin, without the module's torchkit/backbone imports.
    start = rfw_source.index("def load_rfw_bin")
    exec(rfw_source[start:rfw_source.index("def main")], namespace)  # noqa: S102
    out = {}
    for group in RFW_GROUPS:
        data = namespace["load_rfw_bin"](str(folder), f"{group}_test.bin")
        _, _, acc2, _, _, _ = utils.perform_rfw_val_bin(data, backbone, "cpu", batch_size=8)
        out[group] = float(np.max([acc2]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tface", type=Path, required=True, help="a checkout of Tencent/TFace")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    backbone = build_backbone("iresnet_tiny", embedding_size=64).eval()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for g, group in enumerate(RFW_GROUPS):
            write_orl_verification_bin(folder / f"{group}_test.bin",
                                       range(1 + 10 * g, 11 + 10 * g), num_impostor_pairs=450)
        with torch.no_grad():
            theirs = _tface_rfw(args.tface, folder, backbone)
        ours = evaluate_rfw_dir(backbone, folder, batch_size=64, device="cpu")
        exact = evaluate_rfw_dir(backbone, folder, batch_size=64, device="cpu", rule="exact")
    print(f"{'group':10}  {'TFace (%)':>9}  {'ours (%)':>9}  {'difference':>10}  "
          f"{'exact rule (%)':>14}")
    for group in RFW_GROUPS:
        a, b = 100 * theirs[group], 100 * ours[f"RFW/{group}"]["accuracy"]
        print(f"{group:10}  {a:9.4f}  {b:9.4f}  {b - a:10.2e}  "
              f"{100 * exact[f'RFW/{group}']['accuracy']:14.4f}")
    accuracies = np.array([theirs[g] for g in RFW_GROUPS])
    print(f"mean: TFace {100 * accuracies.mean():.4f}, ours {100 * ours['RFW']['mean']:.4f}; "
          f"std: TFace {np.std(100 * accuracies, ddof=1):.4f}, ours "
          f"{100 * ours['RFW']['std']:.4f}")


if __name__ == "__main__":
    main()
