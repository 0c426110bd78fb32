"""The monitor's pure model: replayed steps, the run's state, what panels show, human units.
No textual, no zmq, no torch."""
