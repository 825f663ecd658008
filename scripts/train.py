"""Pretrain a base model: nanochat's base_train.py in JAX.

    python -m scripts.train --depth=20                      # all devices of this host
    python -m scripts.train --depth=4 --max-seq-len=512 --device-batch-size=1 --eval-tokens=512 \
        --core-metric-every=-1 --total-batch-size=512 --num-iterations=20   # a tiny CPU run

Every flag of base_train.py keeps its name, default and meaning; the JAX-only ones are grouped at
the end. Multi-host: start one process per host with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set (or under SLURM's srun); each process feeds the devices it owns.
"""

import argparse
import dataclasses
import signal
import sys
import time

from jaxchat.checkpoint import LATEST, parse_resume_step
from jaxchat.common import fail, select_platform

# -----------------------------------------------------------------------------
# CLI arguments (before JAX: --device-type decides which backend starts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Pretrain base model")
    # Logging
    parser.add_argument("--run", type=str, default="dummy", help="wandb run name ('dummy' disables wandb logging)")
    # Runtime
    parser.add_argument("--device-type", type=str, default="", help="cuda|cpu (empty = autodetect)")
    # FP8 training
    parser.add_argument("--fp8", action="store_true", help="enable FP8 training (fast on H100+; emulated, slow, on CPU)")
    parser.add_argument("--fp8-recipe", type=str, default="tensorwise", choices=["rowwise", "tensorwise"], help="FP8 scaling recipe: tensorwise (the only one implemented; rowwise is refused)")
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
    jax_group.add_argument("--remat", type=str, default="dots", choices=["none", "dots", "block"], help="what each block keeps for the backward pass: everything, matmul outputs, or its input only (dots: d20 at device batch 32 fits 80 GB)")
    jax_group.add_argument("--loss-chunk-len", type=int, default=128, help="positions per chunk of the loss head (float32 logits of one chunk at a time)")
    return parser.parse_args(argv)


@dataclasses.dataclass
class LoopState:
    """What the loop carries from step to step besides the arrays; saved in every checkpoint's meta."""

    step: int = 0
    val_bpb: float | None = None  # the last validation bpb
    min_val_bpb: float = float("inf")
    smooth_train_loss: float = 0.0  # EMA of the training loss (debiased when printed)
    total_training_time: float = 0.0  # seconds, after the first 10 steps

    def to_meta(self) -> dict:
        """nanochat's checkpoint fields: step, val_bpb and the rest as loop_state."""
        return {"step": self.step, "val_bpb": self.val_bpb,
                "loop_state": {"min_val_bpb": self.min_val_bpb, "smooth_train_loss": self.smooth_train_loss,
                               "total_training_time": self.total_training_time}}

    @classmethod
    def from_meta(cls, meta: dict) -> "LoopState":
        return cls(step=meta["step"], val_bpb=meta["val_bpb"], **meta["loop_state"])


EMA_BETA = 0.9  # smoothing of the printed training loss
# Exit status of a run stopped by SIGTERM/SIGINT after saving its checkpoint (EX_TEMPFAIL of sysexits.h):
# the run is not finished; the same command with --resume-from-step=latest carries it on. 0: finished.
EXIT_STOPPED = 75


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    from jaxchat.runtime import apply_gpu_defaults

    gpu_defaults_set = apply_gpu_defaults(args.device_type)  # XLA flags and memory fraction: before JAX starts

    from jaxchat.mesh import maybe_initialize_distributed

    maybe_initialize_distributed()  # before anything touches a device
    select_platform(args.device_type)
    from jaxchat.checkpoint import CheckpointError
    from jaxchat.run import SettingsError

    try:
        stopped = train(args, gpu_defaults_set)
    except (SettingsError, CheckpointError) as e:  # the library's messages say what to do
        fail(str(e))
    if stopped:
        sys.exit(EXIT_STOPPED)


def train(args: argparse.Namespace, gpu_defaults_set: list[str] | None = None) -> bool:
    """The run; True when a signal stopped it before its last step (its checkpoint saved)."""
    import jax
    import numpy as np
    import wandb

    from jaxchat.checkpoint import RunCheckpoints, check_writable, checkpoint_dir, tokenizer_info
    from jaxchat.common import DummyWandb, get_base_dir, is_master, peak_flops_per_device, print0, quiet_jax_warnings, tree_nbytes
    from jaxchat.core_eval import download_eval_bundle, evaluate_core
    from jaxchat.dataloader import make_train_loader, make_val_loader
    from jaxchat.engine import SAMPLE_PROMPTS, Engine
    from jaxchat.loss_eval import evaluate_bpb
    from jaxchat.mesh import batch_sharding, make_mesh, put_batch
    from jaxchat.report import get_report
    from jaxchat.run import RunSettings, build_run, gradient_accumulation_steps
    from jaxchat.tokenizer import get_token_bytes, get_tokenizer

    quiet_jax_warnings()
    user_config = vars(args).copy()  # for logging
    settings = RunSettings.from_args(args)
    settings.check()  # before any download or device work
    master_process = is_master()
    wandb_run = DummyWandb() if args.run == "dummy" or not master_process else \
        wandb.init(project="jaxchat", name=args.run, config=user_config)

    # -----------------------------------------------------------------------------
    # The run: model, mesh, batch arithmetic, horizon, optimizer and the state's shapes (jaxchat.run)
    try:
        mesh = make_mesh(settings.num_devices)
    except ValueError as e:
        fail(f"{e} (--num-devices)")
    device = mesh.devices.flat[0]
    world = mesh.devices.size
    print0(f"jaxchat base training | {jax.process_count()} process(es), {world} {device.platform} device(s) in the mesh"
           f" ({device.device_kind}) | {'FSDP' if settings.fsdp else 'data parallel, ZeRO-1 optimizer state'}"
           f" | remat {settings.remat}")
    if gpu_defaults_set:
        print0(f"GPU runtime defaults (not set by you): {' '.join(gpu_defaults_set)}")
    if settings.fp8 and device.platform != "gpu":  # nanochat ignores --fp8 there; here it runs, for testing
        print0(f"--fp8 on {device.platform}: XLA emulates the fp8 types (slow; fp8 GEMMs need a Hopper GPU or newer)")
    gradient_accumulation_steps(settings, world)  # a batch that does not divide fails before any loading
    # CORE during training needs the eval bundle: fetch it now rather than fail hours into the run
    if args.core_metric_every > 0:
        try:
            download_eval_bundle()
        except (RuntimeError, OSError) as e:
            fail(f"{e}\nOr train without CORE: --core-metric-every=-1 (then run scripts.base_eval on the checkpoint)")
    try:
        tokenizer, token_bytes = get_tokenizer(), get_token_bytes()
    except FileNotFoundError as e:
        fail(str(e))

    run = build_run(settings, tokenizer.get_vocab_size(), mesh=mesh, print_fn=print0)
    num_iterations, optimizer = run.num_iterations, run.optimizer

    # Checkpoints: <base_dir>/base_checkpoints/<model_tag or d{depth}>, checked before any compute
    run_checkpoint_dir = checkpoint_dir(args.model_tag, args.depth, get_base_dir())
    check_writable(run_checkpoint_dir, bytes_needed=tree_nbytes(run.state.params, run.state.opt_state))
    checkpointer = RunCheckpoints(run_checkpoint_dir, max_to_keep=None if args.keep_checkpoints < 1 else args.keep_checkpoints)
    resuming = args.resume_from_step != -1
    if args.resume_from_step == LATEST and not checkpointer.all_steps():
        # a requeued job's first start: 'latest' with nothing saved yet means a fresh run
        print0(f"No checkpoint in {run_checkpoint_dir} yet: starting from scratch")
        resuming = False

    # Data: this process's share, (grad_accum, rows of its devices, T) per step
    local_rows = settings.device_batch_size * sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    try:
        train_loader = make_train_loader(tokenizer, local_rows, settings.max_seq_len, run.grad_accum_steps,
                                         jax.process_index(), jax.process_count(), data_dir=args.data_dir,
                                         workers=args.loader_workers)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    eval_steps = args.eval_tokens // run.tokens_per_micro_batch
    if args.eval_every > 0 and eval_steps == 0:
        print0(f"warning: --eval-tokens {args.eval_tokens} is less than one eval batch "
               f"({run.tokens_per_micro_batch} tokens): validation bpb will be inf")

    def val_loader():
        return make_val_loader(tokenizer, local_rows, settings.max_seq_len, jax.process_index(), jax.process_count(),
                               steps=eval_steps, data_dir=args.data_dir, workers=args.loader_workers)

    # The state and the loop state: from the checkpoint, or fresh
    state = run.state
    if resuming:
        state.params, state.opt_state, meta = checkpointer.restore(
            args.resume_from_step, state.params, state.opt_state, state.param_shardings, state.opt_shardings,
            data_iter=train_loader, model_config=run.config, tokenizer=tokenizer)
        loop = LoopState.from_meta(meta)
        print0(f"Resumed optimization from step {loop.step}")
    else:
        state = run.init_state()
        loop = LoopState()
    train_step = run.train_step()
    resume_step = loop.step if resuming else None

    # SIGTERM / SIGINT: finish the step in flight, save, and exit cleanly
    stop_signal = []

    def on_signal(signum, frame):
        if stop_signal:  # a second signal: stop now, without a checkpoint
            raise KeyboardInterrupt
        print0(f"Signal {signum} received: finishing the current step, then saving a checkpoint")
        stop_signal.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    # What a step line prints: the optimizer's own schedules, computed once for every step
    schedules = optimizer.schedules_at(np.arange(num_iterations + 1))
    logger = StepLogger(num_iterations, settings.total_batch_size, run.flops_per_token,
                        peak_flops_per_device(device), world, schedules, wandb_run)
    report = get_report() if master_process else None
    if report is not None and not resuming:
        report.clear_curve()  # a fresh run starts a new curve; a resumed one continues it

    def save(step: int) -> None:
        logger.write_curve(report)
        checkpointer.save(step, state.params, state.opt_state, train_loader, {
            **loop.to_meta(),
            "model_config": dataclasses.asdict(run.config),
            "user_config": user_config,  # inputs to the training script
            "device_batch_size": settings.device_batch_size,
            "max_seq_len": settings.max_seq_len,
            "tokenizer": tokenizer_info(tokenizer),
        })

    # -----------------------------------------------------------------------------
    # Training loop: runs num_iterations+1 times so that we can eval/save at the end
    batch_spec = batch_sharding(mesh)
    results = {}
    while True:
        step = loop.step
        last_step = step == num_iterations
        flops_so_far = run.flops_per_token * settings.total_batch_size * step

        # once in a while: evaluate the val bpb (all processes participate)
        if args.eval_every > 0 and (last_step or step % args.eval_every == 0):
            logger.flush(loop)
            loop.val_bpb = evaluate_bpb(state.model(), val_loader(), eval_steps, token_bytes, mesh)
            print0(f"Step {step:05d} | Validation bpb: {loop.val_bpb:.6f}")
            loop.min_val_bpb = min(loop.min_val_bpb, loop.val_bpb)
            logger.curve.append((step, None, loop.val_bpb))
            logger.write_curve(report)
            wandb_run.log({"step": step, "total_training_flops": flops_so_far,
                           "total_training_time": loop.total_training_time, "val/bpb": loop.val_bpb})
            logger.restart_clock()

        # save checkpoint: at the end of the run, or every save_every steps, except at the first step or the resume step
        # (before CORE and samples, so that nothing they do can cost the run its checkpoint)
        saved = last_step or (step > 0 and step != resume_step and args.save_every > 0 and step % args.save_every == 0)
        if saved:
            logger.flush(loop)
            save(step)

        # once in a while: estimate the CORE metric (all processes participate)
        if args.core_metric_every > 0 and (last_step or (step > 0 and step % args.core_metric_every == 0)):
            logger.flush(loop)
            results = evaluate_core(state.model(), tokenizer, max_per_task=args.core_metric_max_per_task)
            print0(f"Step {step:05d} | CORE metric: {results['core_metric']:.4f}")
            wandb_run.log({"step": step, "total_training_flops": flops_so_far,
                           "core_metric": results["core_metric"], "centered_results": results["centered_results"]})
            logger.restart_clock()

        # once in a while: sample from the model (every process runs it, so that sharded
        # parameters stay usable on several hosts; process 0 prints)
        if args.sample_every > 0 and (last_step or (step > 0 and step % args.sample_every == 0)):
            logger.flush(loop)
            engine = Engine(state.model(), tokenizer)
            for prompt in SAMPLE_PROMPTS:
                sample, _ = engine.generate_batch(tokenizer(prompt, prepend="<|bos|>"), num_samples=1, max_tokens=16,
                                                  temperature=0)
                print0(tokenizer.decode(sample[0]))
            logger.restart_clock()

        if stop_signal and not last_step:
            logger.flush(loop)
            if not saved and step != resume_step:
                save(step)
            checkpointer.wait()
            print0(f"Stopped by signal {stop_signal[0]} after step {step}: checkpoint saved. "
                   f"Resume with --resume-from-step={step}")
            break
        if last_step:
            break

        # single training step: send it, then read the previous step's loss while it runs
        inputs, targets = next(train_loader)
        dispatched_at = time.perf_counter()
        state.params, state.opt_state, metrics = train_step(
            state.params, state.opt_state, put_batch(inputs, batch_spec), put_batch(targets, batch_spec))
        logger.flush(loop)
        logger.pending = (step, metrics, dispatched_at, train_loader.get_state().get("epoch", 1))
        loop.step += 1
    logger.flush(loop)
    logger.write_curve(report)
    checkpointer.close()

    # -----------------------------------------------------------------------------
    # Finish: a few more stats, and the report's section
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    peak_memory = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
    print0(f"Peak memory usage: {peak_memory / 1024 / 1024:.2f}MiB" if peak_memory else "Peak memory usage: n/a (not reported by this backend)")
    print0(f"Total training time: {loop.total_training_time / 60:.2f}m")
    if loop.val_bpb is not None:
        print0(f"Minimum validation bpb: {loop.min_val_bpb:.6f}")
    if report is not None:
        timed_steps = loop.step - 11  # the steps after the 10th are the timed ones (as total_training_time)
        report.log(section="Base model training", data=[
            user_config,  # CLI args
            {  # stats about the training setup
                "Number of parameters": run.num_params,
                "Number of FLOPs per token": f"{run.flops_per_token:e}",
                "Calculated number of iterations": num_iterations,
                "Number of training tokens": settings.total_batch_size * num_iterations,
                "Tokens : Params ratio": settings.total_batch_size * num_iterations / run.num_params,
                "Devices": f"{world} x {device.device_kind}",
                "warmup_ratio": settings.warmup_ratio,
                "warmdown_ratio": settings.warmdown_ratio,
                "final_lr_frac": settings.final_lr_frac,
            },
            {  # stats about training outcomes
                "Minimum validation bpb": loop.min_val_bpb if loop.val_bpb is not None else None,
                "Final validation bpb": loop.val_bpb,
                "CORE metric estimate": results.get("core_metric", None),
                "MFU %": f"{logger.mfu:.2f}%" if logger.mfu is not None else "n/a",
                "Total training flops": f"{run.flops_per_token * settings.total_batch_size * loop.step:e}",
                "Total training time": f"{loop.total_training_time / 60:.2f}m",
                "Average tok/sec": round(settings.total_batch_size * timed_steps / loop.total_training_time)
                if timed_steps > 0 and loop.total_training_time > 0 else "n/a",
                "Peak memory usage": f"{peak_memory / 1024 / 1024:.2f}MiB" if peak_memory else "n/a",
            },
        ])
    wandb_run.finish()
    return bool(stop_signal) and loop.step < num_iterations


class StepLogger:
    """nanochat's step line, read one step late: the device runs the next step while the host reads
    this one's loss. Keeps the loss EMA and the timing in the LoopState, and the report's curve rows."""

    def __init__(self, num_iterations, total_batch_size, flops_per_token, peak_flops, world, schedules, wandb_run):
        self.num_iterations, self.total_batch_size, self.flops_per_token = num_iterations, total_batch_size, flops_per_token
        self.peak_flops, self.world, self.schedules, self.wandb_run = peak_flops, world, schedules, wandb_run
        self.pending = None  # (step, metrics, dispatched_at, epoch) not read yet
        self.curve = []  # (step, loss, val_bpb) rows for the report's CSV, not written yet
        self.mfu = None
        self.restart_clock()

    def restart_clock(self) -> None:
        """After work that is not training (evaluation, sampling): the next step's time starts now."""
        self.last_done = time.perf_counter()

    def write_curve(self, report) -> None:
        """Append the new rows to <base_dir>/report/training_curve.csv (at evals and saves, so the curve on
        disk always reaches the newest checkpoint and a resumed run carries it on)."""
        if report is not None:
            report.append_curve(self.curve)
        self.curve.clear()

    def flush(self, loop: LoopState) -> None:
        """Read the pending step's loss (blocks until it is done) and print its line."""
        if self.pending is None:
            return
        s, metrics, dispatched_at, epoch = self.pending
        self.pending = None
        from jaxchat.common import print0

        loss = float(metrics["loss"])
        now = time.perf_counter()
        dt = now - max(self.last_done, dispatched_at)  # device time of step s: since s-1 finished, or since s was sent
        self.last_done = now
        loop.smooth_train_loss = EMA_BETA * loop.smooth_train_loss + (1 - EMA_BETA) * loss
        smooth = loop.smooth_train_loss / (1 - EMA_BETA ** (s + 1))
        tok_per_sec = int(self.total_batch_size / dt)
        flops_per_sec = self.flops_per_token * self.total_batch_size / dt
        self.mfu = 100 * flops_per_sec / (self.peak_flops * self.world) if self.peak_flops else None
        if s > 10:
            loop.total_training_time += dt  # only count the time after the first 10 steps
        eta = ""
        if s > 10:
            eta = f" | eta: {(self.num_iterations - s) * loop.total_training_time / (s - 10) / 60:.1f}m"
        mfu = f"{self.mfu:.2f}" if self.mfu is not None else "n/a"
        lrm = self.schedules["lrm"][s]
        print0(f"step {s:05d}/{self.num_iterations:05d} ({100 * s / self.num_iterations:.2f}%) | loss: {smooth:.6f} | "
               f"lrm: {lrm:.2f} | dt: {dt * 1000:.2f}ms | tok/sec: {tok_per_sec:,} | mfu: {mfu} | epoch: {epoch} | "
               f"total time: {loop.total_training_time / 60:.2f}m{eta}")
        self.curve.append((s, smooth, None))
        if s % 100 == 0:
            self.wandb_run.log({
                "step": s,
                "total_training_flops": self.flops_per_token * self.total_batch_size * s,
                "total_training_time": loop.total_training_time,
                "train/loss": smooth,
                "train/lrm": float(lrm),
                "train/muon_momentum": float(self.schedules["muon_momentum"][s]),
                "train/weight_decay": float(self.schedules["weight_decay"][s]),
                "train/dt": dt,
                "train/tok_per_sec": tok_per_sec,
                "train/epoch": epoch,
                **({"train/mfu": self.mfu} if self.mfu is not None else {}),  # unknown peak (a CPU): not logged as 0
            })


if __name__ == "__main__":
    main()
