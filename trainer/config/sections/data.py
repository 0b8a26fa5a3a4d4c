"""The ``data:`` section: where the training images come from and how they are read."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from data_pipeline.codec import MAX_PIXELS
from trainer.config.sections.base import NonNegInt, PosFloat, PosInt, Section


class DataConfig(Section):
    source: Literal["shards", "synthetic"] = Field(
        "shards", description="shards: the webdataset folder data.dir; synthetic: learnable "
        "synthetic images generated in batches on the training device "
        "(data_pipeline.synthetic_stream; no folder, data.num_classes required)"
    )
    dir: str = Field(
        "data/synthetic", description="folder of webdataset shards and their manifest.json "
        "(python -m launch.convert writes one), or its URL (s3://, gs://, https://, file://: "
        "streamed, docs/data.md); shards only"
    )
    dirs: list[str] | None = Field(
        None, description="several shard folders trained together instead of data.dir: every "
        "batch mixes them by data.weights, each read once per its own epoch, its labels "
        "offset into one class space (data_pipeline.mixture)"
    )
    weights: list[PosFloat] | None = Field(
        None, description="data.dirs only: each folder's share of every batch; null = their "
        "sample counts"
    )
    exclude: str | list[str | None] | None = Field(
        None, description="an exclusion list (`sample KEY` / `class LABEL` lines, as python -m "
        "launch.overlap writes) left out of training; with data.dirs a list parallel to it "
        "(null: none), each in its folder's own labels"
    )
    merge: str | None = Field(
        None, description="data.dirs only: a merge list (`pair I:CLASS J:CLASS` lines, as "
        "python -m launch.overlap --between writes; `-` strikes a line) whose paired classes "
        "train as one: one class per person (data_pipeline.merge)"
    )
    merge_digest: str | None = Field(
        None, description="filled from data.merge: a digest of its folders and pairs as read "
        "(not its comments or struck lines); a resume with another list is refused"
    )
    num_classes: PosInt | None = Field(
        None, description="identities; shards: filled from manifest.json (data.dirs: their "
        "sum, less the classes data.merge joins; if set, must match); synthetic: required, "
        "the identities generated"
    )
    num_samples: PosInt | None = Field(
        None, description="images per epoch; filled from manifest.json or, synthetic, as "
        "num_classes x synthetic_images_per_class (if set, must match)"
    )
    synthetic_images_per_class: PosInt = Field(
        4, description="synthetic only: images per identity, each a pure function of (seed, "
        "identity, image)"
    )
    num_workers: NonNegInt = Field(
        2, description="loader worker processes per rank decoding shards; 0 = in the main "
        "process (synthetic: unused, batches are generated on the device)"
    )
    flip: bool = Field(True, description="random horizontal flip of training images")
    max_pixels: Annotated[int, Field(ge=112 * 112, le=10**9)] = Field(
        MAX_PIXELS, description="shards: a sample whose image header claims more pixels "
        "(width x height) is skipped and counted before it is decoded (docs/readers.md); at "
        "least the loader's 112 x 112, at most 10^9 (3 GB decoded)"
    )
    cache_dir: str | None = Field(
        None, description="data at a URL: a node-local folder keeping whole shards once fetched "
        "(shared by the node's ranks and workers; later epochs read it); null = stream only"
    )
    cache_gib: PosFloat = Field(100.0, description="data.cache_dir's bound in GiB (least "
                                "recently read shards evicted)")

    def folders(self) -> list[str]:
        """The shard folders read: ``dirs``, else ``[dir]``."""
        return list(self.dirs) if self.dirs is not None else [self.dir]

    def exclusions(self) -> list[str | None]:
        """One exclusion list (or None) per folder of :meth:`folders`."""
        if isinstance(self.exclude, list):
            return list(self.exclude)
        return [self.exclude] * len(self.folders())
