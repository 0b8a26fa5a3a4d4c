"""``python -m launch.overlap``: the train/test overlap and, with ``--between``, the
identities training sets hold twice; ``__main__`` is the program, ``between`` its second mode.
The work is ``offline.overlap``."""
