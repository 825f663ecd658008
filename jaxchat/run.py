"""From a run's settings to everything its steps need, in one place: model config, mesh, batch
arithmetic, horizon, optimizer with its schedules, train state (abstract, then initialised into its
shardings) and the jitted step. scripts.train, scripts.bench, scripts.gpu_check and the tests build here.

The arithmetic is nanochat's (scripts/base_train.py at the commit the README names):
    model_dim = depth x aspect_ratio, heads of about head_dim          (GPTConfig.from_depth)
    grad_accum = total_batch_size / (device_batch_size x max_seq_len x devices), exactly
    steps = num_iterations, else round(target_flops / (flops_per_token x total_batch_size)),
            else target_param_data_ratio x params // total_batch_size
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxchat import fp8
from jaxchat.gpt import REMAT_POLICIES, GPTConfig, use_fp8, width_and_heads
from jaxchat.mesh import batch_sharding, make_mesh
from jaxchat.optim import Optimizer, setup_optimizer
from jaxchat.trainer import TrainState, abstract_model, abstract_train_state, init_train_state, make_train_step


class SettingsError(ValueError):
    """A setting that cannot work; the message says which flag to change and how."""


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The settings that shape a run: base_train.py's flags (same names) and jaxchat's own."""

    depth: int = 20
    aspect_ratio: int = 64
    head_dim: int = 128
    max_seq_len: int = 2048
    window_pattern: str = "SSSL"
    num_iterations: int = -1
    target_flops: float = -1.0
    target_param_data_ratio: int = 8
    device_batch_size: int = 32
    total_batch_size: int = 524288
    embedding_lr: float = 0.3
    unembedding_lr: float = 0.004
    weight_decay: float = 0.2
    matrix_lr: float = 0.02
    scalar_lr: float = 0.5
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    warmup_ratio: float = 0.0
    warmdown_ratio: float = 0.4
    final_lr_frac: float = 0.0
    # jaxchat's own
    num_devices: int = -1  # over all processes; -1: all
    fsdp: bool = False
    seed: int = 42
    attention: str = "auto"  # 'cudnn', 'xla' or 'auto' (cudnn on NVIDIA GPUs)
    remat: str = "dots"  # a key of gpt.REMAT_POLICIES
    loss_chunk_len: int = 128
    compute_dtype: str | None = None  # None: bfloat16 on accelerators, float32 on CPU
    fp8: bool = False  # base_train.py's --fp8: the linear layers nanochat's filter passes train in fp8
    fp8_recipe: str = "tensorwise"  # base_train.py's --fp8-recipe: only tensorwise is implemented (jaxchat.fp8)

    @classmethod
    def from_args(cls, args) -> "RunSettings":
        """The settings among an argparse namespace's attributes (scripts.train's flags)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def check(self) -> None:
        for name in ("depth", "aspect_ratio", "head_dim", "max_seq_len", "device_batch_size", "total_batch_size",
                     "loss_chunk_len"):
            if getattr(self, name) < 1:
                raise SettingsError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if not self.window_pattern or any(c not in "SL" for c in self.window_pattern.upper()):
            raise SettingsError(f"--window-pattern {self.window_pattern!r} must be made of S (half context) and L (full context)")
        if self.num_iterations <= 0 and self.target_flops <= 0 and self.target_param_data_ratio <= 0:
            raise SettingsError("no training horizon: set --num-iterations, --target-flops or --target-param-data-ratio")
        if self.fp8_recipe not in fp8.RECIPES:
            raise SettingsError(f"--fp8-recipe {self.fp8_recipe!r} is not supported: only 'tensorwise' (one scale per "
                                "tensor), as nanochat's own fp8.py; rowwise needs the full torchao library there")
        if self.remat not in REMAT_POLICIES:
            raise SettingsError(f"--remat {self.remat!r}: use one of {', '.join(REMAT_POLICIES)}")
        try:
            width_and_heads(self.depth, self.aspect_ratio, self.head_dim)
        except ValueError as e:
            raise SettingsError(str(e)) from None

    def model_kwargs(self) -> dict:
        kwargs = {"remat": self.remat, "loss_chunk_len": self.loss_chunk_len}
        if self.attention != "auto":
            kwargs["attention_implementation"] = self.attention
        if self.compute_dtype:
            kwargs["dtype"] = jnp.dtype(self.compute_dtype)
        if self.fp8:
            kwargs["fp8"] = True
        return kwargs


@dataclasses.dataclass
class Run:
    settings: RunSettings
    config: GPTConfig
    mesh: Mesh
    grad_accum_steps: int
    num_iterations: int
    num_params: int
    flops_per_token: int
    optimizer: Optimizer
    state: TrainState  # ShapeDtypeStructs until init_state() (or a checkpoint restore) fills it

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.settings.device_batch_size * self.settings.max_seq_len * self.mesh.devices.size

    def init_state(self) -> TrainState:
        """Parameters and optimizer state initialised directly into their shardings."""
        self.state = init_train_state(self.config, self.optimizer, self.mesh, fsdp=self.settings.fsdp,
                                      seed=self.settings.seed, **self.settings.model_kwargs())
        return self.state

    def train_step(self) -> Callable:
        """The jitted step(params, opt_state, inputs, targets) -> (params, opt_state, {'loss'})."""
        return make_train_step(self.state, self.optimizer, self.mesh)


def gradient_accumulation_steps(settings: RunSettings, world: int) -> int:
    """Micro-steps per optimizer step: total_batch_size / (device_batch_size x max_seq_len x devices), exactly."""
    world_tokens = settings.device_batch_size * settings.max_seq_len * world
    if settings.total_batch_size % world_tokens:
        k = max(1, round(settings.total_batch_size / world_tokens))
        raise SettingsError(
            f"--total-batch-size {settings.total_batch_size:,} is not a multiple of device_batch_size x max_seq_len x "
            f"devices = {settings.device_batch_size} x {settings.max_seq_len} x {world} = {world_tokens:,}: use e.g. "
            f"--total-batch-size={k * world_tokens}")
    return settings.total_batch_size // world_tokens


def build_run(settings: RunSettings, vocab_size: int, *, mesh: Mesh | None = None,
              print_fn: Callable[[str], None] | None = None) -> Run:
    """Everything but the arrays: they are allocated by run.init_state() or a checkpoint restore.
    print_fn (e.g. print0) prints nanochat's preamble lines. Raises SettingsError."""
    settings.check()
    say = print_fn or (lambda _: None)
    try:
        mesh = mesh or make_mesh(settings.num_devices)
    except ValueError as e:
        raise SettingsError(f"{e} (--num-devices)") from None
    try:
        config = GPTConfig.from_depth(settings.depth, vocab_size, aspect_ratio=settings.aspect_ratio,
                                      head_dim=settings.head_dim, max_seq_len=settings.max_seq_len,
                                      window_pattern=settings.window_pattern)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    say(f"num_layers: {config.n_layer}")
    say(f"model_dim: {config.n_embd}")
    say(f"num_heads: {config.n_head}")
    say(f"num_kv_heads: {config.n_kv_head}")

    grad_accum_steps = gradient_accumulation_steps(settings, mesh.devices.size)
    tokens_per_fwdbwd = settings.device_batch_size * settings.max_seq_len
    world_tokens = tokens_per_fwdbwd * mesh.devices.size
    say(f"Tokens / micro-batch / device: {settings.device_batch_size} x {settings.max_seq_len} = {tokens_per_fwdbwd:,}")
    say(f"Tokens / micro-batch: {world_tokens:,}")
    say(f"Total batch size {settings.total_batch_size:,} => gradient accumulation steps: {grad_accum_steps}")
    say(f"Vocab size: {vocab_size:,}")

    model_kwargs = settings.model_kwargs()
    model = abstract_model(config, settings.seed, **model_kwargs)  # ShapeDtypeStructs only: nothing allocated
    num_params = model.num_scaling_params()
    flops_per_token = model.estimate_flops()
    say(f"Number of parameters: {num_params:,} (scaling: {num_params:,})")
    say(f"Estimated FLOPs per token: {flops_per_token:e}")
    if settings.fp8:
        converted, linear = use_fp8(model)
        say(f"✓ FP8 training enabled ({settings.fp8_recipe} scaling) - converted {converted}/{linear} linear layers, "
            f"skipped {linear - converted} (too small)")

    # the horizon: given, or from target flops, or from the data:param ratio (in that order)
    if settings.num_iterations > 0:
        num_iterations = settings.num_iterations
        say(f"Using user-provided number of iterations: {num_iterations:,}")
    elif settings.target_flops > 0:
        num_iterations = round(settings.target_flops / (flops_per_token * settings.total_batch_size))
        say(f"Calculated number of iterations from target FLOPs: {num_iterations:,}")
    else:
        num_iterations = settings.target_param_data_ratio * num_params // settings.total_batch_size
        say(f"Calculated number of iterations from target data:param ratio: {num_iterations:,}")
    if num_iterations < 1:
        raise SettingsError(f"the horizon gives {num_iterations} iterations: raise --target-flops / "
                            "--target-param-data-ratio, or set --num-iterations")
    total_tokens = settings.total_batch_size * num_iterations
    say(f"Total number of training tokens: {total_tokens:,}")
    say(f"Tokens : Params ratio: {total_tokens / num_params:.2f}")
    say(f"Total training FLOPs estimate: {flops_per_token * total_tokens:e}")

    try:
        optimizer = setup_optimizer(
            nnx.state(model, nnx.Param), model_dim=config.n_embd, depth=config.n_layer, num_iterations=num_iterations,
            total_batch_size=settings.total_batch_size, unembedding_lr=settings.unembedding_lr,
            embedding_lr=settings.embedding_lr, matrix_lr=settings.matrix_lr, scalar_lr=settings.scalar_lr,
            weight_decay=settings.weight_decay, adam_betas=(settings.adam_beta1, settings.adam_beta2),
            warmup_ratio=settings.warmup_ratio, warmdown_ratio=settings.warmdown_ratio,
            final_lr_frac=settings.final_lr_frac, mesh=mesh, print_fn=print_fn)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    state = abstract_train_state(config, optimizer, mesh, fsdp=settings.fsdp, seed=settings.seed, **model_kwargs)
    return Run(settings, config, mesh, grad_accum_steps, num_iterations, num_params, flops_per_token, optimizer, state)


def abstract_batch(run: Run) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """(inputs, targets) of one step as shapes with their sharding: for lowering without data."""
    shape = (run.grad_accum_steps, run.settings.device_batch_size * run.mesh.devices.size, run.settings.max_seq_len)
    batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(run.mesh))
    return batch, batch
