"""The processes and their devices: the mesh and its shardings, many hosts (agreement, failures), XLA runtime settings."""
