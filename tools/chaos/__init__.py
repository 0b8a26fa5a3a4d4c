"""Fault injection end to end on CPU: the cases by the fault they inject (``numeric``,
``checkpoints``, ``signals``, ``inputs``, ``jobs``; ``two_nodes``, ``store_nodes`` and
``elastic`` for the two-node rows), ``cases`` (the one table, SLURM's rows from
:mod:`tools.slurm.rows`) and ``__main__`` (the command line). They run the trainer through
:mod:`tools.testbed`."""
