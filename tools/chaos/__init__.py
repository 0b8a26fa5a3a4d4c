"""Fault injection end to end on CPU: ``harness`` (run the trainer, inject a fault, a case's
record), the cases by the fault they inject (``numeric``, ``checkpoints``, ``signals``,
``inputs``, ``slurm_rows``; ``elastic`` and ``nodes`` for the two-node rows), ``cases`` (the
one table) and ``__main__`` (the command line)."""
