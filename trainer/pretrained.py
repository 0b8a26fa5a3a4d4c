"""Read a shipped backbone folder (``model.safetensors`` plus ``config.json``, which
``python -m launch.export --format safetensors`` writes) back into a model.

``partial_fc.pretrained`` holds the folder's format (:class:`PretrainedConfig`, the writer
and the architecture it names) and reads no file: ``partial_fc`` imports nothing of the
other packages, and every file from outside comes through ``data_pipeline.door``. Here
``config.json`` comes through it (:func:`data_pipeline.json_file.read_json`, 1 MiB: the file
is ~500 bytes), and safetensors reads the weights (a header it bounds itself, tensors only,
no pickle), so a folder from a stranger is safe to read.
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_model
from torch import nn

from data_pipeline.json_file import read_json
from partial_fc.pretrained import CONFIG_FILE, WEIGHTS_FILE, PretrainedConfig, build_pretrained

MAX_CONFIG_BYTES = 1 << 20


def load_pretrained(folder: str | os.PathLike) -> nn.Module:
    """The backbone of a folder ``partial_fc.pretrained.save_pretrained`` wrote, on CPU in
    eval mode.

    Raises:
        ValueError: no such folder, a missing, oversized or foreign ``config.json``, or
            weights that do not fit the architecture it names (one line each).
    """
    folder = Path(folder)
    config_path, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for path in (config_path, weights):
        if not path.is_file():
            raise ValueError(f"{path}: missing (a pretrained folder holds {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE})")
    raw = read_json(config_path, "a pretrained config.json", expect=None,
                    limit=MAX_CONFIG_BYTES, error=ValueError)
    config = PretrainedConfig.from_dict(raw, str(config_path))
    model = build_pretrained(config)
    try:
        load_model(model, str(weights), strict=True)
    except RuntimeError as exc:
        why = " ".join(str(exc).strip().splitlines()[:2])
        raise ValueError(f"{weights}: does not fit {config.architecture!r}: {why}") from None
    return model.eval()
