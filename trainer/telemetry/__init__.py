"""What a run tells its operator: the rank-0 logger (``logger``), the console and progress bar
(``console``), W&B / TensorBoard sinks (``sinks``; W&B's own run files read back by
``wandb_log``), the run folder's files (``run_files``) and the evaluation rows
(``evaluation_log``). The report's figures are ``offline``'s."""
