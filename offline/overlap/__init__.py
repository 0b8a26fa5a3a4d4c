"""Which identities a training set shares, with the evaluation sets (``launch.overlap``) or
with other training sets (``launch.overlap --between``), each listed at a threshold
calibrated for its search. One module a step, in the order the work runs:

``eval_sets`` reads the evaluation sets; ``centres`` makes the training identities' centres
(and keeps the null probes in the same pass); ``search`` finds each probe's nearest centre;
``held_out`` names the identities a run never trained on, the null's probes; ``calibration``
reads the threshold off the null's searches; ``matches`` lists the identities the evaluation
sets share, with their evidence, and ``pairs`` the classes training sets hold twice;
``figure`` and ``pairs_page`` write what a person checks.
"""
