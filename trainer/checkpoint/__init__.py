"""Checkpoints: the folder layout (``layout``), finding the one to resume or read (``find``),
a run folder at a URL (``in_store``), what each engine's state is (``state``), SHA-256
integrity (``integrity``), and reading a backbone back (``backbone``)."""

from trainer.checkpoint.find import LATEST, find_resume, find_verified
from trainer.checkpoint.integrity import CheckpointError, read_meta, verify
from trainer.checkpoint.layout import load, remove_stale, save, tag_for
from trainer.checkpoint.meta import CheckpointMeta, RunRecord

__all__ = ["LATEST", "CheckpointError", "CheckpointMeta", "RunRecord", "find_resume",
           "find_verified", "load", "read_meta", "remove_stale", "save", "tag_for", "verify"]
