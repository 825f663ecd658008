"""The step compiled for accelerators this machine does not have: compile-only targets, HLO census, memory estimate."""
