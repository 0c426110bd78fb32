"""What the agent and the monitor share, and nothing else: the messages (wire), the training
thread's log codes (logcodes), how agents are found (discovery) and the CURVE key files (keys).

Imports only msgspec and the standard library, and importing it starts and registers nothing:
the monitor imports this package of the agent's and no other.
"""
