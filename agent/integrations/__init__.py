"""Optional integrations; each imports its framework lazily, only when used."""
