"""Pretrain a base model: nanochat's base_train.py in JAX.

    python -m scripts.train --depth=20                      # all devices of this host
    python -m scripts.train --depth=4 --max-seq-len=512 --device-batch-size=1 --eval-tokens=512 \
        --core-metric-every=-1 --total-batch-size=512 --num-iterations=20   # a tiny CPU run

Every flag of base_train.py keeps its name, default and meaning; the JAX-only ones are grouped at
the end. Multi-host: start one process per host with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set (or under SLURM's srun); each process feeds the devices it owns.
"""

import argparse
import signal
import sys
import time

from jaxchat.checkpoint import LATEST, parse_resume_step

# -----------------------------------------------------------------------------
# CLI arguments (before JAX: --device-type decides which backend starts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Pretrain base model")
    # Logging
    parser.add_argument("--run", type=str, default="dummy", help="wandb run name ('dummy' disables wandb logging)")
    # Runtime
    parser.add_argument("--device-type", type=str, default="", help="cuda|cpu (empty = autodetect)")
    # Model architecture
    parser.add_argument("--depth", type=int, default=20, help="depth of the Transformer model")
    parser.add_argument("--aspect-ratio", type=int, default=64, help="model_dim = depth * aspect_ratio")
    parser.add_argument("--head-dim", type=int, default=128, help="target head dimension for attention")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="max context length")
    parser.add_argument("--window-pattern", type=str, default="SSSL", help="sliding window pattern tiled across layers: L=full, S=half context (e.g. 'SSL')")
    # Training horizon (only one used, in order of precedence)
    parser.add_argument("--num-iterations", type=int, default=-1, help="explicit number of optimization steps (-1 = disable)")
    parser.add_argument("--target-flops", type=float, default=-1.0, help="calculate num_iterations to reach target_flops (-1 = disable)")
    parser.add_argument("--target-param-data-ratio", type=int, default=8, help="calculate num_iterations to maintain data:param ratio (Chinchilla=20, -1 = disable)")
    # Optimization
    parser.add_argument("--device-batch-size", type=int, default=32, help="per-device batch size")
    parser.add_argument("--total-batch-size", type=int, default=524288, help="total batch size in tokens")
    parser.add_argument("--embedding-lr", type=float, default=0.3, help="learning rate for embedding parameters (Adam)")
    parser.add_argument("--unembedding-lr", type=float, default=0.004, help="learning rate for unembedding parameters (Adam)")
    parser.add_argument("--weight-decay", type=float, default=0.2, help="cautious weight decay for the Muon optimizer (for weights)")
    parser.add_argument("--matrix-lr", type=float, default=0.02, help="learning rate for matrix parameters (Muon)")
    parser.add_argument("--scalar-lr", type=float, default=0.5, help="learning rate for scalars (resid_lambdas, x0_lambdas)")
    parser.add_argument("--adam-beta1", type=float, default=0.8, help="Adam beta1 for embedding/unembedding")
    parser.add_argument("--adam-beta2", type=float, default=0.95, help="Adam beta2 for embedding/unembedding")
    parser.add_argument("--warmup-ratio", type=float, default=0.0, help="ratio of iterations for LR warmup")
    parser.add_argument("--warmdown-ratio", type=float, default=0.4, help="ratio of iterations for LR warmdown")
    parser.add_argument("--final-lr-frac", type=float, default=0.0, help="final LR as fraction of initial LR")
    parser.add_argument("--resume-from-step", type=parse_resume_step, default=-1, help="resume training from this step (-1 = disable, 'latest' = newest complete checkpoint, or a fresh start if there is none)")
    # Evaluation
    parser.add_argument("--eval-every", type=int, default=250, help="evaluate val bpb every N steps (-1 = disable)")
    parser.add_argument("--eval-tokens", type=int, default=20 * 524288, help="number of tokens to evaluate val loss on")
    parser.add_argument("--core-metric-every", type=int, default=2000, help="evaluate CORE metric every N steps (-1 = disable)")
    parser.add_argument("--core-metric-max-per-task", type=int, default=500, help="examples per task for CORE metric")
    parser.add_argument("--sample-every", type=int, default=2000, help="sample from model every N steps (-1 = disable)")
    parser.add_argument("--save-every", type=int, default=-1, help="save checkpoints every N steps (-1 = only at end)")
    # Output
    parser.add_argument("--model-tag", type=str, default=None, help="override model tag for checkpoint directory name")
    # JAX only
    jax_group = parser.add_argument_group("JAX")
    jax_group.add_argument("--num-devices", type=int, default=-1, help="devices in the mesh, over all processes (-1 = all)")
    jax_group.add_argument("--fsdp", action="store_true", help="shard parameters over the data axis too (ZeRO-3), for depths whose state does not fit")
    jax_group.add_argument("--data-dir", type=str, default=None, help="parquet shards (default: <base_dir>/base_data)")
    jax_group.add_argument("--seed", type=int, default=42, help="seed of the model initialisation")
    jax_group.add_argument("--keep-checkpoints", type=int, default=-1, help="keep only the newest N checkpoints (-1 = all)")
    jax_group.add_argument("--attention", type=str, default="auto", choices=["auto", "cudnn", "xla"], help="attention kernel (auto: cudnn on NVIDIA GPUs, xla elsewhere)")
    jax_group.add_argument("--loader-workers", type=int, default=4, help="threads reading and tokenising data")
    return parser.parse_args(argv)


def fail(message: str) -> None:
    """Bad input: say what to change, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def validate_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before any device is touched."""
    for name in ("depth", "aspect_ratio", "head_dim", "max_seq_len", "device_batch_size", "total_batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.device_type not in ("", "cuda", "gpu", "cpu", "tpu"):
        hint = " (JAX has no MPS backend)" if args.device_type == "mps" else ""
        fail(f"--device-type {args.device_type!r} is not supported{hint}: use cuda, cpu, or leave it empty to autodetect")
    if not args.window_pattern or any(c not in "SL" for c in args.window_pattern.upper()):
        fail(f"--window-pattern {args.window_pattern!r} must be made of S (half context) and L (full context)")
    if args.num_iterations <= 0 and args.target_flops <= 0 and args.target_param_data_ratio <= 0:
        fail("no training horizon: set --num-iterations, --target-flops or --target-param-data-ratio")


def select_platform(device_type: str) -> None:
    """Start the backend the user asked for, or explain why it is not there."""
    import jax

    if device_type == "cpu":
        jax.config.update("jax_platforms", "cpu")
    try:
        present = jax.default_backend()  # 'gpu', 'tpu' or 'cpu'
    except (RuntimeError, AssertionError) as e:
        fail(f"no JAX backend could start ({e or type(e).__name__}); check $JAX_PLATFORMS, or use --device-type=cpu")
    wanted = {"cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(device_type)
    if wanted and present != wanted:
        extra = " Install the GPU build with `pip install -e '.[cuda12]'`." if wanted == "gpu" else ""
        fail(f"--device-type {device_type} asked for, but no such device is present (JAX sees: {present}).{extra} "
             "Use --device-type=cpu, or leave it empty to autodetect.")


# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    user_config = vars(args).copy()  # for logging
    validate_args(args)

    from jaxchat.runtime import apply_gpu_defaults

    gpu_defaults_set = apply_gpu_defaults(args.device_type)  # XLA flags and memory fraction: before JAX starts

    from jaxchat.mesh import maybe_initialize_distributed

    maybe_initialize_distributed()  # before anything touches a device
    select_platform(args.device_type)

    import jax
    import numpy as np
    import wandb
    from flax import nnx

    from jaxchat.checkpoint import CheckpointError, Checkpointer, check_writable, checkpoint_dir, tokenizer_info
    from jaxchat.common import DummyWandb, get_base_dir, is_master, peak_flops_per_device, print0, quiet_jax_warnings, tree_nbytes
    from jaxchat.core_eval import download_eval_bundle, evaluate_core
    from jaxchat.dataloader import make_train_loader, make_val_loader
    from jaxchat.engine import SAMPLE_PROMPTS, Engine
    from jaxchat.gpt import GPTConfig, estimate_flops, find_num_heads
    from jaxchat.loss_eval import evaluate_bpb
    from jaxchat.mesh import batch_sharding, make_mesh, put_batch
    from jaxchat.optim import lr_multiplier, muon_momentum, scaled_weight_decay, setup_optimizer, weight_decay_at
    from jaxchat.report import get_report
    from jaxchat.tokenizer import get_token_bytes, get_tokenizer
    from jaxchat.trainer import abstract_model, abstract_train_state, init_train_state, make_train_step

    quiet_jax_warnings()
    try:
        mesh = make_mesh(args.num_devices)
    except ValueError as e:
        fail(f"{e} (--num-devices)")
    world = mesh.devices.size
    local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    master_process = is_master()
    platform = mesh.devices.flat[0].platform
    print0(f"jaxchat base training | {jax.process_count()} process(es), {world} {platform} device(s) in the mesh"
           f" ({mesh.devices.flat[0].device_kind}) | {'FSDP' if args.fsdp else 'data parallel, ZeRO-1 optimizer state'}")
    if gpu_defaults_set:
        print0(f"GPU runtime defaults (not set by you): {' '.join(gpu_defaults_set)}")

    # wandb logging init
    use_dummy_wandb = args.run == "dummy" or not master_process
    wandb_run = DummyWandb() if use_dummy_wandb else wandb.init(project="jaxchat", name=args.run, config=user_config)

    # Model kwargs are derived from the desired depth of the model
    num_layers = args.depth
    model_dim = args.depth * args.aspect_ratio
    num_heads = find_num_heads(model_dim, args.head_dim)
    num_kv_heads = num_heads  # default is 1:1 GQA (Group Query Attention) ratio (i.e. GQA is disabled)
    if (model_dim // num_heads) % 2:
        fail(f"model_dim {model_dim} with {num_heads} heads gives an odd head size {model_dim // num_heads}, and rotary "
             "embeddings need an even one: change --depth, --aspect-ratio or --head-dim")
    print0(f"num_layers: {num_layers}")
    print0(f"model_dim: {model_dim}")
    print0(f"num_heads: {num_heads}")
    print0(f"num_kv_heads: {num_kv_heads}")

    # figure out the needed gradient accumulation to reach the desired total batch size
    tokens_per_fwdbwd = args.device_batch_size * args.max_seq_len  # tokens per iteration for a single device
    world_tokens_per_fwdbwd = tokens_per_fwdbwd * world  # total tokens per iteration for all devices
    if args.total_batch_size % world_tokens_per_fwdbwd:
        k = max(1, round(args.total_batch_size / world_tokens_per_fwdbwd))
        fail(f"--total-batch-size {args.total_batch_size:,} is not a multiple of device_batch_size x max_seq_len x devices "
             f"= {args.device_batch_size} x {args.max_seq_len} x {world} = {world_tokens_per_fwdbwd:,}: "
             f"use e.g. --total-batch-size={k * world_tokens_per_fwdbwd}")
    grad_accum_steps = args.total_batch_size // world_tokens_per_fwdbwd
    print0(f"Tokens / micro-batch / device: {args.device_batch_size} x {args.max_seq_len} = {tokens_per_fwdbwd:,}")
    print0(f"Tokens / micro-batch: {world_tokens_per_fwdbwd:,}")
    print0(f"Total batch size {args.total_batch_size:,} => gradient accumulation steps: {grad_accum_steps}")

    # CORE during training needs the eval bundle: fetch it now rather than fail hours into the run
    if args.core_metric_every > 0:
        try:
            download_eval_bundle()
        except (RuntimeError, OSError) as e:
            fail(f"{e}\nOr train without CORE: --core-metric-every=-1 (then run scripts.base_eval on the checkpoint)")

    # Tokenizer will be useful for evaluation, also we need the vocab size
    try:
        tokenizer = get_tokenizer()
        token_bytes = get_token_bytes()
    except FileNotFoundError as e:
        fail(str(e))
    vocab_size = tokenizer.get_vocab_size()
    print0(f"Vocab size: {vocab_size:,}")

    # -----------------------------------------------------------------------------
    # Model and optimizer, initialised directly into their shardings
    model_config_kwargs = dict(sequence_len=args.max_seq_len, vocab_size=vocab_size, n_layer=num_layers,
                               n_head=num_heads, n_kv_head=num_kv_heads, n_embd=model_dim,
                               window_pattern=args.window_pattern)
    model_config = GPTConfig(**model_config_kwargs)
    model_kwargs = {} if args.attention == "auto" else {"attention_implementation": args.attention}
    model_shapes = abstract_model(model_config, **model_kwargs)  # ShapeDtypeStructs only: nothing allocated
    num_params = model_shapes.num_scaling_params()
    num_scaling_params = num_params
    print0(f"Number of parameters: {num_params:,} (scaling: {num_scaling_params:,})")
    num_flops_per_token = estimate_flops(model_config)
    print0(f"Estimated FLOPs per token: {num_flops_per_token:e}")

    # Calculate number of iterations. Either it is given, or from target flops, or from target data:param ratio (in that order)
    if args.num_iterations > 0:
        num_iterations = args.num_iterations
        print0(f"Using user-provided number of iterations: {num_iterations:,}")
    elif args.target_flops > 0:
        num_iterations = round(args.target_flops / (num_flops_per_token * args.total_batch_size))
        print0(f"Calculated number of iterations from target FLOPs: {num_iterations:,}")
    else:
        target_tokens = args.target_param_data_ratio * num_scaling_params
        num_iterations = target_tokens // args.total_batch_size
        print0(f"Calculated number of iterations from target data:param ratio: {num_iterations:,}")
    if num_iterations < 1:
        fail(f"the horizon gives {num_iterations} iterations: raise --target-flops / --target-param-data-ratio, "
             "or set --num-iterations")
    total_tokens = args.total_batch_size * num_iterations
    print0(f"Total number of training tokens: {total_tokens:,}")
    print0(f"Tokens : Params ratio: {args.total_batch_size * num_iterations / num_scaling_params:.2f}")
    print0(f"Total training FLOPs estimate: {num_flops_per_token * total_tokens:e}")

    optimizer = setup_optimizer(
        nnx.state(model_shapes, nnx.Param),  # every parameter must land in a group: checked now
        model_dim=model_dim, depth=num_layers, num_iterations=num_iterations, total_batch_size=args.total_batch_size,
        unembedding_lr=args.unembedding_lr, embedding_lr=args.embedding_lr, matrix_lr=args.matrix_lr,
        scalar_lr=args.scalar_lr, weight_decay=args.weight_decay, adam_betas=(args.adam_beta1, args.adam_beta2),
        warmup_ratio=args.warmup_ratio, warmdown_ratio=args.warmdown_ratio, final_lr_frac=args.final_lr_frac,
        mesh=mesh, print_fn=print0,
    )
    resuming = args.resume_from_step != -1
    state = abstract_train_state(model_config, optimizer, mesh, fsdp=args.fsdp, seed=args.seed, **model_kwargs)

    # Checkpoints: <base_dir>/base_checkpoints/<model_tag or d{depth}>, checked before any compute
    run_checkpoint_dir = checkpoint_dir(args.model_tag, args.depth, get_base_dir())
    try:
        check_writable(run_checkpoint_dir, bytes_needed=tree_nbytes(state.params, state.opt_state))
    except CheckpointError as e:
        fail(str(e))
    checkpointer = Checkpointer(run_checkpoint_dir, max_to_keep=None if args.keep_checkpoints < 1 else args.keep_checkpoints)
    if args.resume_from_step == LATEST and not checkpointer.all_steps():
        # a requeued job's first start: 'latest' with nothing saved yet means a fresh run
        print0(f"No checkpoint in {run_checkpoint_dir} yet: starting from scratch")
        resuming = False

    # -----------------------------------------------------------------------------
    # Data: this process's share, (grad_accum, rows of its devices, T) per step
    local_rows = args.device_batch_size * local_devices
    try:
        train_loader = make_train_loader(tokenizer, local_rows, args.max_seq_len, grad_accum_steps,
                                         jax.process_index(), jax.process_count(), data_dir=args.data_dir,
                                         workers=args.loader_workers)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    eval_steps = args.eval_tokens // (args.device_batch_size * args.max_seq_len * world)
    if args.eval_every > 0 and eval_steps == 0:
        print0(f"warning: --eval-tokens {args.eval_tokens} is less than one eval batch "
               f"({args.device_batch_size * args.max_seq_len * world} tokens): validation bpb will be inf")

    def build_val_loader():
        return make_val_loader(tokenizer, local_rows, args.max_seq_len, jax.process_index(), jax.process_count(),
                               steps=eval_steps, data_dir=args.data_dir, workers=args.loader_workers)

    # -----------------------------------------------------------------------------
    # Loop state (variables updated by the training loop), fresh or from the checkpoint
    step = 0
    val_bpb = None  # will be set if eval_every > 0
    min_val_bpb = float("inf")
    smooth_train_loss = 0.0  # EMA of training loss
    total_training_time = 0.0  # total wall-clock time of training
    if resuming:
        try:
            state.params, state.opt_state, meta_data = checkpointer.restore(
                args.resume_from_step, state.params, state.opt_state, state.param_shardings, state.opt_shardings,
                data_iter=train_loader, model_config=model_config, tokenizer=tokenizer)
        except CheckpointError as e:
            fail(str(e))
        step = meta_data["step"]
        loop_state = meta_data["loop_state"]
        val_bpb = meta_data["val_bpb"]
        min_val_bpb = loop_state["min_val_bpb"]
        smooth_train_loss = loop_state["smooth_train_loss"]
        total_training_time = loop_state["total_training_time"]
        print0(f"Resumed optimization from step {step}")
    else:
        state = init_train_state(model_config, optimizer, mesh, fsdp=args.fsdp, seed=args.seed, **model_kwargs)
    train_step = make_train_step(state, optimizer, mesh)
    resume_step_taken = step if resuming else None

    # SIGTERM / SIGINT: finish the step in flight, save, and exit cleanly
    stop_signal = []

    def on_signal(signum, frame):
        if stop_signal:  # a second signal: stop now, without a checkpoint
            raise KeyboardInterrupt
        print0(f"Signal {signum} received: finishing the current step, then saving a checkpoint")
        stop_signal.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    batch_spec = batch_sharding(mesh)
    # The schedules' values at every step, for logging: computed once, read on the host without a device op
    all_steps = np.arange(num_iterations + 1)
    lrm_table = np.asarray(lr_multiplier(all_steps, num_iterations, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac))
    momentum_table = np.asarray(muon_momentum(all_steps))
    weight_decay_table = np.asarray(weight_decay_at(all_steps, scaled_weight_decay(args.weight_decay, args.depth), num_iterations))
    peak_flops = peak_flops_per_device(mesh.devices.flat[0])
    ema_beta = 0.9  # EMA decay factor for some smoothing just for nicer logging
    results = {}
    mfu = None
    pending = None  # the step whose metrics are not read yet: the device runs ahead of the host by one step
    last_done = time.perf_counter()
    epoch = train_loader.get_state().get("epoch", 1)
    history = []  # (step, loss, val_bpb) for the report's curve, not yet in its CSV
    if master_process and not resuming:
        get_report().clear_curve()  # a fresh run starts a new curve; a resumed one continues it

    def write_history() -> None:
        """Append the new rows to <base_dir>/report/training_curve.csv (at evals and saves, so the
        curve on disk always reaches the newest checkpoint and a resumed run carries it on)."""
        if master_process:
            get_report().append_curve(history)
        history.clear()

    def log_step(s: int, metrics, dispatched_at: float, epoch: int) -> None:
        """Read step s's loss (blocks until s is done; s+1 is already queued) and print its line."""
        nonlocal smooth_train_loss, total_training_time, last_done, mfu
        train_loss_f = float(metrics["loss"])
        now = time.perf_counter()
        dt = now - max(last_done, dispatched_at)  # device time of step s: since s-1 finished, or since s was sent
        last_done = now
        smooth_train_loss = ema_beta * smooth_train_loss + (1 - ema_beta) * train_loss_f
        debiased_smooth_loss = smooth_train_loss / (1 - ema_beta ** (s + 1))
        pct_done = 100 * s / num_iterations
        tok_per_sec = int(args.total_batch_size / dt)
        flops_per_sec = num_flops_per_token * args.total_batch_size / dt
        mfu = 100 * flops_per_sec / (peak_flops * world) if peak_flops else None
        if s > 10:
            total_training_time += dt  # only count the time after the first 10 steps
        steps_done = s - 10
        eta_str = ""
        if steps_done > 0:
            eta_seconds = (num_iterations - s) * total_training_time / steps_done
            eta_str = f" | eta: {eta_seconds / 60:.1f}m"
        mfu_str = f"{mfu:.2f}" if mfu is not None else "n/a"
        print0(f"step {s:05d}/{num_iterations:05d} ({pct_done:.2f}%) | loss: {debiased_smooth_loss:.6f} | "
               f"lrm: {lrm_table[s]:.2f} | "
               f"dt: {dt * 1000:.2f}ms | tok/sec: {tok_per_sec:,} | mfu: {mfu_str} | epoch: {epoch} | "
               f"total time: {total_training_time / 60:.2f}m{eta_str}")
        history.append((s, debiased_smooth_loss, None))
        if s % 100 == 0:
            wandb_run.log({
                "step": s,
                "total_training_flops": num_flops_per_token * args.total_batch_size * s,
                "total_training_time": total_training_time,
                "train/loss": debiased_smooth_loss,
                "train/lrm": float(lrm_table[s]),
                "train/muon_momentum": float(momentum_table[s]),
                "train/weight_decay": float(weight_decay_table[s]),
                "train/dt": dt,
                "train/tok_per_sec": tok_per_sec,
                "train/epoch": epoch,
                **({"train/mfu": mfu} if mfu is not None else {}),  # unknown peak (e.g. a CPU): not logged as 0
            })

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            log_step(*pending)
            pending = None

    def save(at_step: int) -> None:
        write_history()
        checkpointer.save(at_step, state.params, state.opt_state, train_loader, {
            "step": at_step,
            "val_bpb": val_bpb,  # loss at last step
            "model_config": model_config_kwargs,
            "user_config": user_config,  # inputs to the training script
            "device_batch_size": args.device_batch_size,
            "max_seq_len": args.max_seq_len,
            "tokenizer": tokenizer_info(tokenizer),
            "loop_state": {  # all loop state (other than step) so that we can resume training
                "min_val_bpb": min_val_bpb,
                "smooth_train_loss": smooth_train_loss,
                "total_training_time": total_training_time,
            },
        })

    # -----------------------------------------------------------------------------
    # Training loop: runs num_iterations+1 times so that we can eval/save at the end
    while True:
        last_step = step == num_iterations
        flops_so_far = num_flops_per_token * args.total_batch_size * step

        # once in a while: evaluate the val bpb (all processes participate)
        if args.eval_every > 0 and (last_step or step % args.eval_every == 0):
            flush()
            val_bpb = evaluate_bpb(state.model(), build_val_loader(), eval_steps, token_bytes, mesh)
            print0(f"Step {step:05d} | Validation bpb: {val_bpb:.6f}")
            min_val_bpb = min(min_val_bpb, val_bpb)
            history.append((step, None, val_bpb))
            write_history()
            wandb_run.log({"step": step, "total_training_flops": flops_so_far,
                           "total_training_time": total_training_time, "val/bpb": val_bpb})
            last_done = time.perf_counter()

        # save checkpoint: at the end of the run, or every save_every steps, except at the first step or the resume step
        # (before CORE and samples, so that nothing they do can cost the run its checkpoint)
        saved = last_step or (step > 0 and step != resume_step_taken and args.save_every > 0 and step % args.save_every == 0)
        if saved:
            flush()
            save(step)

        # once in a while: estimate the CORE metric (all processes participate)
        if args.core_metric_every > 0 and (last_step or (step > 0 and step % args.core_metric_every == 0)):
            flush()
            results = evaluate_core(state.model(), tokenizer, max_per_task=args.core_metric_max_per_task)
            print0(f"Step {step:05d} | CORE metric: {results['core_metric']:.4f}")
            wandb_run.log({"step": step, "total_training_flops": flops_so_far,
                           "core_metric": results["core_metric"], "centered_results": results["centered_results"]})
            last_done = time.perf_counter()

        # once in a while: sample from the model (every process runs it, so that sharded
        # parameters stay usable on several hosts; process 0 prints)
        if args.sample_every > 0 and (last_step or (step > 0 and step % args.sample_every == 0)):
            flush()
            engine = Engine(state.model(), tokenizer)
            for prompt in SAMPLE_PROMPTS:
                tokens = tokenizer(prompt, prepend="<|bos|>")
                sample, _ = engine.generate_batch(tokens, num_samples=1, max_tokens=16, temperature=0)
                print0(tokenizer.decode(sample[0]))
            last_done = time.perf_counter()

        if stop_signal and not last_step:
            flush()
            if not saved and step != resume_step_taken:
                save(step)
            checkpointer.wait()
            print0(f"Stopped by signal {stop_signal[0]} after step {step}: checkpoint saved. "
                   f"Resume with --resume-from-step={step}")
            break

        # termination conditions
        if last_step:
            break

        # -------------------------------------------------------------------------
        # single training step: send it, then read the previous step's loss while it runs
        inputs, targets = next(train_loader)
        dispatched_at = time.perf_counter()
        state.params, state.opt_state, metrics = train_step(
            state.params, state.opt_state, put_batch(inputs, batch_spec), put_batch(targets, batch_spec))
        flush()
        epoch = train_loader.get_state().get("epoch", epoch)
        pending = (step, metrics, dispatched_at, epoch)
        step += 1
    flush()
    write_history()
    checkpointer.wait()
    checkpointer.close()

    # print a few more stats
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    peak_memory = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
    print0(f"Peak memory usage: {peak_memory / 1024 / 1024:.2f}MiB" if peak_memory else "Peak memory usage: n/a (not reported by this backend)")
    print0(f"Total training time: {total_training_time / 60:.2f}m")
    if val_bpb is not None:
        print0(f"Minimum validation bpb: {min_val_bpb:.6f}")

    if master_process:
        get_report().log(section="Base model training", data=[
            user_config,  # CLI args
            {  # stats about the training setup
                "Number of parameters": num_params,
                "Number of FLOPs per token": f"{num_flops_per_token:e}",
                "Calculated number of iterations": num_iterations,
                "Number of training tokens": total_tokens,
                "Tokens : Params ratio": args.total_batch_size * num_iterations / num_params,
                "Devices": f"{world} x {mesh.devices.flat[0].device_kind}",
                "warmup_ratio": args.warmup_ratio,
                "warmdown_ratio": args.warmdown_ratio,
                "final_lr_frac": args.final_lr_frac,
            },
            {  # stats about training outcomes
                "Minimum validation bpb": min_val_bpb if val_bpb is not None else None,
                "Final validation bpb": val_bpb,
                "CORE metric estimate": results.get("core_metric", None),
                "MFU %": f"{mfu:.2f}%" if mfu is not None else "n/a",
                "Total training flops": f"{num_flops_per_token * args.total_batch_size * step:e}",
                "Total training time": f"{total_training_time / 60:.2f}m",
                # the steps after the 10th are the timed ones (as total_training_time)
                "Average tok/sec": round(args.total_batch_size * (step - 11) / total_training_time) if step > 11 and total_training_time > 0 else "n/a",
                "Peak memory usage": f"{peak_memory / 1024 / 1024:.2f}MiB" if peak_memory else "n/a",
            },
        ])
    wandb_run.finish()


if __name__ == "__main__":
    main()
