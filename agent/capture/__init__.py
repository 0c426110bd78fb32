"""On-demand captures: armed by the agent thread, started and stopped on the training thread
at step boundaries, written and summarised on a writer thread."""
