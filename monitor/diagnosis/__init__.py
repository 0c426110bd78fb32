"""What holds a run back: facts reduced from the state, the verdict and flag rules, the
report. Pure: no textual, no zmq, no torch."""
