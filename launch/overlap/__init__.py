"""``python -m launch.overlap``: ``__main__`` is the command line and its help; its two modes
are ``against_eval_sets`` (the training identities the evaluation sets share) and ``between``
(``--between``: the identities training sets hold twice); ``held_out`` reads ``--held-out``,
which both take. The work is ``offline.overlap``."""
