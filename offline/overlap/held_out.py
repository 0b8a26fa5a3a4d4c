"""The identities a run never trained on: the null probes ``launch.overlap`` calibrates on.

A run trained with ``data.exclude`` left the ``class`` lines of that list out of every
epoch; its ``config.yaml`` (the resolved config ``launch.train`` writes into the run folder)
names the list. Those identities' images were never seen, so they search the other
identities' centres as an evaluation image whose person is not in training does: the
calibration's null, exchangeable with the images it bounds (``offline.overlap.calibration``).
The list is read where the run names it (a path relative to where it trained); ``sample``
lines hold out single images of trained identities and do not count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.exclusion import read_exclusions
from data_pipeline.merge import same_folder
from offline.overlap.calibration import CalibrationError
from trainer.yaml_file import YamlRefused, read_mapping

FIX = ("train with identities held out (data.exclude, docs/data.md), pass --held-out LIST, "
       "set --threshold, or calibrate on the training images with --training-null "
       "(optimistic: lists more than the FPIR)")


@dataclass(frozen=True)
class HeldOut:
    """``classes`` (labels of the folder searched) the run never trained on, and the
    ``source`` that says so (``RUN's data.exclude=LIST``)."""

    classes: frozenset[int]
    source: str

    def line(self) -> str:
        """The line ``launch.overlap`` prints before calibrating on them."""
        return (f"null probes: the images of the {len(self.classes)} identities held out of "
                f"training ({self.source}), which the model never saw")


def run_held_out(config: str | os.PathLike, data: str) -> HeldOut:
    """The ``class`` lines of the exclusion list the run of ``config`` (its
    ``RUN/config.yaml``) trained the folder ``data`` with. CalibrationError, naming the fix,
    where it has none, or none of its folders (``data.dir``, ``data.dirs``) is ``data``."""
    config = Path(config)
    try:
        section = read_mapping(config).get("data") or {}
    except YamlRefused as err:
        raise CalibrationError(str(err)) from None
    folders = section.get("dirs") or [section.get("dir")]
    exclude = section.get("exclude")
    lists = exclude if isinstance(exclude, list) else [exclude] * len(folders)
    run = config.parent
    if not any(lists):
        raise CalibrationError(f"{run} trained on every identity of {data} (no data.exclude), "
                               f"so no image of it is an unseen person's: {FIX}")
    same = [i for i, folder in enumerate(folders) if folder and same_folder(folder, data)]
    if not same:
        raise CalibrationError(f"{run} trained on {', '.join(map(str, folders))}, not --data "
                               f"{data}: pass --held-out LIST (the identities of --data it "
                               "never trained on) or set --threshold")
    chosen = lists[same[0]]
    if chosen is None:
        raise CalibrationError(f"{run} held no identity of {data} out (data.exclude: none for "
                               f"that folder), so no image of it is an unseen person's: {FIX}")
    try:
        classes = read_exclusions(chosen).classes
    except DataError as err:
        raise CalibrationError(f"{run}: data.exclude={chosen}, the identities it held out, "
                               f"cannot be read here ({str(err).splitlines()[0]}); run from "
                               "where it trained, or pass --held-out LIST") from err
    if not classes:
        raise CalibrationError(f"{run} held no identity of {data} out (data.exclude={chosen} "
                               f"has no `class` lines), so no image of it is an unseen "
                               f"person's: {FIX}")
    return HeldOut(classes, f"{run}'s data.exclude={chosen}")

