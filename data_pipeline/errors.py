"""Exception types for problems a user can cause with their data.

Every message is one line naming the file (and the key or value) at fault, so a
multi-node run's log says which shard to look at without a stack trace.
"""


class DataError(ValueError):
    """The data on disk does not match what was asked for (bad folder, manifest, label, ...)."""


class ShardError(DataError):
    """A shard listed in the manifest is missing, truncated or not a tar file."""


class CorruptImageError(DataError):
    """One image's bytes cannot be decoded; the loader skips and counts these."""
