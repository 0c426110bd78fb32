"""Runs on the training thread: the probe's log, the wrappers and hooks that write it, and the
explicit API (step, phase, mark, data). Clock reads, sampled CUDA event records and list
appends only; everything else is the agent thread's."""
