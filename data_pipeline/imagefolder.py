"""Source for a folder of aligned face images, one sub-folder per identity.

Identities are the sub-folders sorted by name (plain string order), labelled 0..C-1; images
are the files with an image extension in each, sorted by name. Hidden entries are ignored;
`exclude` takes fnmatch patterns on the path relative to the root (e.g. "s10/target.jpg").
An identity folder left with no image is an error: a class with no samples still costs a
head row and usually means a wrong path.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from data_pipeline.codec import MAX_IMAGE_BYTES
from data_pipeline.door import read_bytes
from data_pipeline.errors import DataError
from data_pipeline.identities import Identities

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".pgm", ".ppm", ".pbm", ".bmp",
                              ".webp", ".tif", ".tiff"})


class ImageFolderSource:
    """`Source` (see writer.py) over ROOT/<identity>/<image>."""

    def __init__(self, root: str | os.PathLike, *, exclude: tuple[str, ...] | list[str] = (),
                 identities: list[str] | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"{self.root}: not a folder (give a folder with one sub-folder of "
                            "aligned face images per identity)")
        self.exclude = tuple(exclude)
        folders = sorted(p.name for p in self.root.iterdir()
                         if p.is_dir() and not p.name.startswith("."))
        if identities is not None:
            missing = sorted(set(identities) - set(folders))
            if missing:
                raise DataError(f"{self.root}: identity folders {missing} not found")
            folders = sorted(identities)
        if not folders:
            raise DataError(f"{self.root}: no identity sub-folders")
        self.identities = folders
        self.num_classes = len(folders)
        self.items: list[tuple[str, int]] = []
        for label, name in enumerate(folders):
            files = [f"{name}/{p.name}" for p in sorted((self.root / name).iterdir())
                     if p.is_file() and not p.name.startswith(".")
                     and p.suffix.lower() in IMAGE_EXTENSIONS]
            files = [f for f in files if not any(fnmatch.fnmatch(f, x) for x in self.exclude)]
            if not files:
                raise DataError(f"{self.root / name}: identity folder holds no images")
            self.items.extend((f, label) for f in files)

    def __len__(self) -> int:
        return len(self.items)

    def describe(self) -> dict:
        return {"type": "imagefolder", "path": str(self.root.resolve()),
                "exclude": list(self.exclude), "identities": len(self.identities)}

    def identity_map(self) -> Identities:
        return Identities(tuple(self.identities),
                          f"the identity folder names of {self.root.resolve()}")

    def read(self, index: int) -> tuple[bytes, int, str]:
        rel, label = self.items[index]
        return read_bytes(self.root / rel, "a source image", limit=MAX_IMAGE_BYTES), label, rel
