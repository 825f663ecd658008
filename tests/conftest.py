"""Every test runs on the CPU with 8 virtual devices, so multi-device code is tested
without a GPU. Must run before JAX is imported anywhere."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("WANDB_MODE", "disabled")
