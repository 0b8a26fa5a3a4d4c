"""What a run tells its operator: the rank-0 logger (``logger``), the console and progress bar
(``console``), W&B / TensorBoard sinks (``sinks``), the run folder's files (``run_files``)
and the report's figures (``figures``)."""
