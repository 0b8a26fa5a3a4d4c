"""A real two-node SLURM cluster on one machine (network namespaces), for the chaos rows that run
scripts/slurm/train.sbatch and for ``make slurm-demo``."""
