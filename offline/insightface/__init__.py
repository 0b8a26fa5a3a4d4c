"""Importing insightface arcface_torch: its backbones' keys, checkpoints and configs."""
