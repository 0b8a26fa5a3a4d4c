"""What runs beside training, not in it: the planner (``plan``, ``plan_inputs``), the
report's figures (``report_figures``), cleaning label noise and test-set overlap
(``cleaning``, and the ``overlap`` package: its evaluation sets, calibrated search, the
identities a run held out, pairs held twice and figures; over ``folder_scan``), and the
arcface_torch import (``insightface``).

These read run folders, checkpoints and data folders through ``trainer`` and
``data_pipeline``; ``trainer`` never imports them (docs/design.md). ``launch/`` holds the
programs that call them.
"""
