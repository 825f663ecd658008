"""One training run: the settings (the flags), the run built from them, the step, the loop, step timing, profiles."""
