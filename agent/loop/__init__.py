"""Runs on the agent's own thread: the tick that drains the probe's log, resolves its CUDA
events, keeps the late-join history and publishes; the request router; the sockets."""
