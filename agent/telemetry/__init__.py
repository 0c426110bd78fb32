"""Memory, GPU and host samplers: the agent thread's fast tick and the slow sampler thread."""
