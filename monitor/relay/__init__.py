"""A node's relay (docs/multi-rank.md): one process per node and job between the ranks and monitors."""
