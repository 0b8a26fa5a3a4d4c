"""Developer tooling, not installed with the package (fault injection: ``tools.chaos``)."""
