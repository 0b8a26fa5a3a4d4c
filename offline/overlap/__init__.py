"""Which identities a training set shares, with the evaluation sets (``launch.overlap``) or
with other training sets (``launch.overlap --between``), each listed at a threshold
calibrated for its search.

``eval_sets`` reads the evaluation sets; ``matches`` makes the training centres and searches
the sets' images against them; ``calibration`` searches centres and reads the threshold off
a null search; ``held_out`` names the identities a run never trained on (the null's
probes); ``pairs`` finds classes held twice; ``figure`` and ``pairs_page`` write what a
person checks.
"""
