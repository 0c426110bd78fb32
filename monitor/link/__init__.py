"""The link to agents: targets, the ZeroMQ client, SSH tunnels. No textual, no torch."""
