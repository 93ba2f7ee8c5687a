"""seqio tasks and mixtures of the SPEED paper, registered on import."""
