"""What every engine shares: the protocols (engine, weight source), the decoder block loop, the base class."""
