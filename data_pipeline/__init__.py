"""Data pipeline: convert face data sets to webdataset tar shards and stream them to training.

Public API: `make_loader` (an `EpochBatches`, the batch-source interface; a local folder or
a URL, data_pipeline.remote), `read_manifest`,
`write_synthetic_dataset`, `write_dataset`,
`SyntheticStream` (synthetic batches generated on the device, no files),
`Manifest`, and the error types; `data_pipeline.orl.find_orl_root` for the ORL test faces.
"""

from data_pipeline.epoch_batches import EpochBatches
from data_pipeline.errors import CorruptImageError, DataError, ShardError
from data_pipeline.loader import make_loader
from data_pipeline.manifest import Manifest, ShardInfo, read_manifest
from data_pipeline.synthetic import write_synthetic_dataset
from data_pipeline.synthetic_stream import SyntheticStream
from data_pipeline.writer import write_dataset

__all__ = ["CorruptImageError", "DataError", "EpochBatches", "Manifest", "ShardError", "ShardInfo",
           "SyntheticStream", "make_loader", "read_manifest", "write_dataset",
           "write_synthetic_dataset"]
