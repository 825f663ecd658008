"""From a run's settings to everything its steps need, in one place: model config, mesh, batch
arithmetic, horizon, optimizer with its schedules, train state (abstract, then initialised into its
shardings) and the jitted step. scripts.train, scripts.bench, scripts.gpu_check and the tests build here.
The settings themselves (and their one check) are jaxchat.train.settings'; RunSettings and SettingsError are
re-exported here.

The arithmetic is nanochat's (scripts/base_train.py at the commit the README names):
    model_dim = depth x aspect_ratio, heads of about head_dim          (GPTConfig.from_depth)
    grad_accum = total_batch_size / (device_batch_size x max_seq_len x devices), exactly
    steps = num_iterations, else round(target_flops / (flops_per_token x total_batch_size)),
            else int(target_param_data_ratio x scaling params) // total_batch_size
and, at nanochat 92d63d4, --total-batch-size -1: the batch of jaxchat.optim.recipes.auto_total_batch_size from the
target tokens over d12's (the same ratio times d12's scaling params), and weight decay scaled by them too.
"""

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxchat.checkpoint.meta import CheckpointMismatchError, step_meta_file
from jaxchat.model.footprint import XLA_MARGIN, choose_remat, device_budget, model_kept_activations, remat_needs, state_bytes
from jaxchat.model.gpt import GPTConfig, count_params, use_fp8
from jaxchat.distributed.mesh import batch_sharding, make_mesh
from jaxchat.optim.recipes import Horizon, Optimizer, auto_total_batch_size, optimizer_recipe, setup_optimizer
from jaxchat.train.settings import RESOLVED, RunSettings, SettingsError, resume_difference
from jaxchat.train.loop import LoopState
from jaxchat.train.trainer import TrainState, abstract_model, abstract_train_state, init_train_state, make_train_step


@dataclasses.dataclass
class Run:
    settings: RunSettings
    config: GPTConfig
    mesh: Mesh
    grad_accum_steps: int
    total_batch_size: int  # tokens per optimizer step: the setting's, or the recipe's rule for -1
    num_iterations: int
    num_params: int
    flops_per_token: int
    compute_dtype: str  # of the matmuls: the setting's, else the platform's (bfloat16 on accelerators, float32 on CPU)
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

    def resolved(self) -> dict:
        """What the settings resolved to (jaxchat.train.settings.RESOLVED), as a checkpoint's meta records them."""
        return {name: getattr(self, name) for name in RESOLVED}

    def check_resume(self, meta: dict, directory: str) -> None:
        """Before a checkpoint of the run directory is resumed (its arrays read): CheckpointMismatchError, one
        line, if the run that saved it differs from this one in a setting that changes the maths
        (jaxchat.train.settings.resume_difference: a batch, horizon or learning rate changed mid-run would train another
        run under this one's name), or if its meta lacks the loop's state."""
        step = meta["step"]
        LoopState.from_meta(meta, where=step_meta_file(directory, step))
        difference = resume_difference(meta, self.settings, self.resolved())
        if difference:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {directory} was saved by a run with other settings: {difference}. A "
                "resumed run keeps its checkpoint's settings (README: Training flags): resume with that run's own, or "
                f"start a new run from these weights with --init-from {os.path.join(directory, str(step))} "
                "--model-tag <a new tag> in place of --resume-from-step")

    def training_flops(self, steps: int) -> int:
        """FLOPs of the first `steps` optimizer steps (nanochat's estimate: flops_per_token x tokens)."""
        return self.flops_per_token * self.total_batch_size * steps


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a run's batches go: the mesh, and the micro-steps of one optimizer step. Checked once, when made:
    a script makes it before any download, so that a batch that does not divide fails at once."""

    mesh: Mesh
    grad_accum_steps: int | None  # None: the batch size is the recipe's rule's, known once the model is


def make_layout(settings: RunSettings, mesh: Mesh | None = None, total_batch_size: int | None = None) -> Layout:
    """The mesh (given, or settings.num_devices of all devices) and
    grad_accum = total_batch_size / (device_batch_size x max_seq_len x devices), exactly; total_batch_size
    defaults to the setting's (for -1, auto, grad_accum waits for build_run). Raises SettingsError."""
    try:
        mesh = mesh or make_mesh(settings.num_devices)
    except ValueError as e:
        raise SettingsError(f"{e} (--num-devices)") from None
    total = settings.total_batch_size if total_batch_size is None else total_batch_size
    if total == -1:
        return Layout(mesh, None)
    world_tokens = settings.device_batch_size * settings.max_seq_len * mesh.devices.size
    if total % world_tokens:
        k = max(1, round(total / world_tokens))
        what = "--total-batch-size" if total_batch_size is None else "the automatic total batch size"
        raise SettingsError(
            f"{what} {total:,} is not a multiple of device_batch_size x max_seq_len x "
            f"devices = {settings.device_batch_size} x {settings.max_seq_len} x {mesh.devices.size} = "
            f"{world_tokens:,}: use e.g. --total-batch-size={k * world_tokens}")
    return Layout(mesh, total // world_tokens)


def model_config(settings: RunSettings, vocab_size: int, depth: int | None = None) -> GPTConfig:
    """The GPT of these settings (at another depth: the d12 reference of the batch-size rule)."""
    return GPTConfig.from_depth(depth or settings.depth, vocab_size, aspect_ratio=settings.aspect_ratio,
                                head_dim=settings.head_dim, max_seq_len=settings.max_seq_len,
                                window_pattern=settings.window_pattern, recipe=settings.recipe)


def batch_and_horizon(settings: RunSettings, vocab_size: int, num_params: int,
                      say: Callable[[str], None]) -> tuple[int, Horizon | None]:
    """(total batch size, Horizon) of a recipe whose rules scale by the horizon (92d63d4): D = int(ratio x
    scaling params), D_ref = ratio x d12's, and for --total-batch-size -1 the batch from them; else
    (the setting, None)."""
    if optimizer_recipe(settings.recipe).weight_decay_rule != "horizon":
        return settings.total_batch_size, None
    ratio = settings.target_param_data_ratio  # -1 (off) too: D / D_ref and the decay rule do not depend on it
    reference_params = abstract_model(model_config(settings, vocab_size, 12), settings.seed,
                                      **settings.model_kwargs()).num_scaling_params()
    horizon = Horizon(int(ratio * num_params), ratio * reference_params)
    total_batch_size = settings.total_batch_size
    if total_batch_size == -1:
        total_batch_size = auto_total_batch_size(horizon.target_tokens, horizon.reference_tokens)
        say(f"Auto-computed optimal batch size: {total_batch_size:,} tokens")
    return total_batch_size, horizon


def training_horizon(settings: RunSettings, num_params: int, flops_per_token: int, total_batch_size: int,
                     say: Callable[[str], None]) -> int:
    """Steps: given, or from target flops, or from the data:param ratio (in that order, as base_train.py)."""
    if settings.num_iterations > 0:
        num_iterations = settings.num_iterations
        say(f"Using user-provided number of iterations: {num_iterations:,}")
    elif settings.target_flops > 0:
        num_iterations = round(settings.target_flops / (flops_per_token * total_batch_size))
        say(f"Calculated number of iterations from target FLOPs: {num_iterations:,}")
    else:
        # int(): a recipe's ratio may be a float (nanochat 92d63d4's 12.0); floor(int(x) / B) = floor(x / B), so
        # this is 92d63d4's target_tokens // B, and bdcc030's int ratio gives the same int as before
        num_iterations = int(settings.target_param_data_ratio * num_params // total_batch_size)
        say(f"Calculated number of iterations from target data:param ratio: {num_iterations:,}")
    if num_iterations < 1:
        raise SettingsError(f"the horizon gives {num_iterations} iterations: raise --target-flops / "
                            "--target-param-data-ratio, or set --num-iterations")
    return num_iterations


def build_run(settings: RunSettings, vocab_size: int, *, mesh: Mesh | None = None, layout: Layout | None = None,
              print_fn: Callable[[str], None] | None = None, memory_budget: tuple[int, str] | None = None) -> Run:
    """Everything but the arrays: they are allocated by run.init_state() or a checkpoint restore. The settings
    were checked when built; layout: the script's (else made here, on `mesh` or settings.num_devices).
    print_fn (e.g. print0) prints nanochat's preamble lines. memory_budget: (bytes, where from) of the device
    --remat auto decides for (default: the mesh's, jaxchat.model.footprint.device_budget). Raises SettingsError."""
    say = print_fn or (lambda _: None)
    asked_auto = settings.remat == "auto"
    if asked_auto:  # a stand-in until resolve_remat: what the blocks keep changes no shape of the state
        settings = dataclasses.replace(settings, remat="none")
    layout = layout or make_layout(settings, mesh)
    config = model_config(settings, vocab_size)
    say(f"num_layers: {config.n_layer}")
    say(f"model_dim: {config.n_embd}")
    say(f"num_heads: {config.n_head}")
    say(f"num_kv_heads: {config.n_kv_head}")
    say(f"Vocab size: {vocab_size:,}")

    model_kwargs = settings.model_kwargs()
    model = abstract_model(config, settings.seed, **model_kwargs)  # ShapeDtypeStructs only: nothing allocated
    num_params = model.num_scaling_params()  # what the data:param horizon counts (the recipe's rule)
    flops_per_token = model.estimate_flops()
    say(f"Number of parameters: {count_params(nnx.state(model, nnx.Param)):,} (scaling: {num_params:,})")
    say(f"Estimated FLOPs per token: {flops_per_token:e}")
    if settings.fp8:
        converted, linear = use_fp8(model)
        say(f"✓ FP8 training enabled ({settings.fp8_recipe} scaling) - converted {converted}/{linear} linear layers, "
            f"skipped {linear - converted} (too small)")
    total_batch_size, horizon = batch_and_horizon(settings, vocab_size, num_params, say)
    if layout.grad_accum_steps is None:
        layout = make_layout(settings, layout.mesh, total_batch_size)
    mesh = layout.mesh
    tokens_per_fwdbwd = settings.device_batch_size * settings.max_seq_len
    say(f"Tokens / micro-batch / device: {settings.device_batch_size} x {settings.max_seq_len} = {tokens_per_fwdbwd:,}")
    say(f"Tokens / micro-batch: {tokens_per_fwdbwd * mesh.devices.size:,}")
    say(f"Total batch size {total_batch_size:,} => gradient accumulation steps: {layout.grad_accum_steps}")
    num_iterations = training_horizon(settings, num_params, flops_per_token, total_batch_size, say)
    total_tokens = total_batch_size * num_iterations
    say(f"Total number of training tokens: {total_tokens:,}")
    say(f"Tokens : Params ratio: {total_tokens / num_params:.2f}")
    say(f"Total training FLOPs estimate: {flops_per_token * total_tokens:e}")

    try:
        optimizer = setup_optimizer(
            nnx.state(model, nnx.Param), model_dim=config.n_embd, depth=config.n_layer, num_iterations=num_iterations,
            total_batch_size=total_batch_size, unembedding_lr=settings.unembedding_lr,
            embedding_lr=settings.embedding_lr, matrix_lr=settings.matrix_lr, scalar_lr=settings.scalar_lr,
            weight_decay=settings.weight_decay, adam_betas=(settings.adam_beta1, settings.adam_beta2),
            warmup_ratio=settings.warmup_ratio, warmup_steps=settings.warmup_steps,
            warmdown_ratio=settings.warmdown_ratio, final_lr_frac=settings.final_lr_frac, recipe=settings.recipe,
            horizon=horizon, mesh=mesh, print_fn=print_fn, compute_dtype=model.dtype)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    state = abstract_train_state(config, optimizer, mesh, fsdp=settings.fsdp, seed=settings.seed, **model_kwargs)
    if asked_auto:
        settings = resolve_remat(settings, config, state, memory_budget or mesh_budget(mesh), say)
        if settings.remat != "none":
            state = abstract_train_state(config, optimizer, mesh, fsdp=settings.fsdp, seed=settings.seed,
                                         **settings.model_kwargs())
    return Run(settings, config, mesh, layout.grad_accum_steps, total_batch_size, num_iterations, num_params,
               flops_per_token, str(model.dtype), optimizer, state)


def mesh_budget(mesh: Mesh) -> tuple[int, str]:
    """The budget of this process's first device in the mesh."""
    return device_budget(next(d for d in mesh.devices.flat if d.process_index == jax.process_index()))


def resolve_remat(settings: RunSettings, config: GPTConfig, state: TrainState, memory_budget: tuple[int, str],
                  say: Callable[[str], None]) -> RunSettings:
    """--remat auto, before anything compiles: the cheapest policy whose estimated per-device memory (the
    state's bytes and the kept activations of one micro-batch, jaxchat.model.footprint) fits memory_budget (bytes, where
    from), with XLA_MARGIN of its budget to spare. Says the choice and the estimate in one line;
    the settings returned run that policy and record that 'auto' asked for it."""
    budget, source = memory_budget
    state_total = sum(state_bytes(state).values())

    def kept_bytes(policy: str) -> int:
        kwargs = dataclasses.replace(settings, remat=policy).model_kwargs()
        kept = model_kept_activations(config, settings.device_batch_size, settings.max_seq_len, **kwargs)
        return sum(r["bytes"] for r in kept)

    policy, need, fits = choose_remat(remat_needs(state_total, kept_bytes), budget)
    gib = 2**30
    say(f"remat auto: {policy} (estimate {need / gib:.2f} GiB per device: state {state_total / gib:.2f} + kept "
        f"activations {(need - state_total) / gib:.2f}; {'fits' if fits else 'does NOT fit, even so,'} "
        f"{1 - XLA_MARGIN:.0%} of {budget / gib:.2f} GiB, {source})")
    return dataclasses.replace(settings, remat=policy, remat_asked="auto")


def abstract_batch(run: Run) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """(inputs, targets) of one step as shapes with their sharding: for lowering without data."""
    shape = (run.grad_accum_steps, run.settings.device_batch_size * run.mesh.devices.size, run.settings.max_seq_len)
    batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(run.mesh))
    return batch, batch


def abstract_step_arguments(run: Run) -> tuple:
    """run.train_step()'s four arguments (params, opt_state, inputs, targets) as shapes with their shardings:
    what lowers and compiles the step before any array exists (jit(...).trace(*these).lower().compile())."""
    def with_shardings(tree, shardings):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    state = run.state
    return (with_shardings(state.params, state.param_shardings), with_shardings(state.opt_state, state.opt_shardings),
            *abstract_batch(run))
