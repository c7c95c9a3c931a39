"""Plain decoding pieces: sampling parameters, stop strings, the token loop."""
