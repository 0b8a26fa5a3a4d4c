"""The training library: config, engines, checkpoints, telemetry and the loop.

``launch/`` holds the programs that drive it; ``partial_fc`` (the math) and ``data_pipeline``
(the input) know nothing of it. See docs/design.md for the house plan.
"""
