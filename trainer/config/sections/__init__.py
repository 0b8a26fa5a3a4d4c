"""The config schema's sections, one file each (or a few that belong together), every key
with its type, bounds, default and description; :mod:`trainer.config.schema` composes them."""
