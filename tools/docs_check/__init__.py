"""``make docs-check``: every command in README.md's and docs/*.md's code blocks, run as a user
types it on small data the check builds (blocks.py reads the docs, fixtures.py builds the data,
runner.py runs and judges)."""
