"""Evaluation: bits per byte on the validation split, the CORE benchmark."""
