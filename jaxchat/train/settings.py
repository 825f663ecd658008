"""Every training setting in one place: its name, default, help, group and check, as dataclass fields
with metadata (as levanter/draccus do). scripts.train's command line is generated from RunSettings;
a recipe is a named set of overrides of these defaults, plus the model's feature switches.

    settings = parse_settings(["--depth=4", "--recipe=bdcc030"])   # checked once, when built
    parser = build_parser()                                          # for --help

The defaults are base_train.py's at nanochat commit bdcc030 (the `bdcc030` recipe); a flag's name is
the field's with dashes (`total_batch_size` -> `--total-batch-size`).
"""

import argparse
import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

from jaxchat.checkpoint.meta import LATEST, check_model_tag, parse_resume_step
from jaxchat.model.fp8 import RECIPES as FP8_RECIPES
from jaxchat.distributed.compilation_cache import FLAG_HELP as COMPILATION_CACHE_HELP
from jaxchat.distributed.mesh import HEARTBEAT_TIMEOUT_S
from jaxchat.train.profiling import ProfileStepsError, parse_profile_steps
from jaxchat.model.gpt import DEFAULT_RECIPE, REMAT_POLICIES, check_window_pattern, width_and_heads
from jaxchat.data.shards import DEFAULT_CORPUS, get_data_dir


class SettingsError(ValueError):
    """A setting that cannot work; the message says which flag to change and how."""


# ---- recipes --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named, complete set of choices taken from one nanochat commit.

    defaults: settings whose default differs from RunSettings' field defaults (the bdcc030 values).
    replaced: flags this recipe does not have -> what replaced them (the one line a user gets).
    The model of the recipe is the GPT of the same name (jaxchat.model.gpt.RECIPES: value embeddings, smear, ...),
    which GPTConfig.recipe selects.
    auto_batch: --total-batch-size -1 picks the batch size by the recipe's rule (jaxchat.optim.recipes).
    corpus: the downloaded corpus the recipe trains on (FineWeb-Edu at bdcc030, ClimbMix at 92d63d4).
    A setting that only some recipes have says so in its field's `recipes` metadata."""

    name: str
    nanochat_commit: str
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    replaced: Mapping[str, str] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    auto_batch: bool = False
    corpus: str = DEFAULT_CORPUS  # a key of jaxchat.data.shards.CORPORA: where --data-dir defaults to


RECIPES: Mapping[str, Recipe] = types.MappingProxyType({
    recipe.name: recipe for recipe in (
        # nanochat in January 2026 (scripts/base_train.py at bdcc030): the field defaults below
        Recipe(name="bdcc030", nanochat_commit="bdcc030"),
        # nanochat in July 2026 (scripts/base_train.py and nanochat/optim.py at 92d63d4); its optimizer is
        # jaxchat.optim.recipes.OPTIMIZER_RECIPES["92d63d4"]
        Recipe(
            name="92d63d4", nanochat_commit="92d63d4", auto_batch=True, corpus="climbmix",
            defaults=types.MappingProxyType({
                "target_param_data_ratio": 12.0, "total_batch_size": -1, "unembedding_lr": 0.008, "weight_decay": 0.28,
                "warmup_steps": 40, "warmdown_ratio": 0.65, "final_lr_frac": 0.05, "eval_tokens": 80 * 524288}),
            replaced=types.MappingProxyType({
                "adam_beta1": "each AdamW group has its own betas there (jaxchat.optim.recipes.OPTIMIZER_RECIPES)",
                "adam_beta2": "each AdamW group has its own betas there (jaxchat.optim.recipes.OPTIMIZER_RECIPES)",
                "warmup_ratio": "it warms up over a number of steps: use --warmup-steps"})),
    )
})


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise SettingsError(f"--recipe {name!r} is not a recipe: use one of {', '.join(RECIPES)}")
    return RECIPES[name]


# ---- the settings ---------------------------------------------------------------------------------

# How a resumed run's setting is compared with the checkpoint's (each field's `resume`; scripts.train compares
# before any array is read, and the README's Training flags section lists the flags of each kind):
FREE = "free"  # changes none of the run's maths (cadence, logging, layout on the devices, kernels): may differ
SAME = "same"  # changes the maths: must be the value the checkpoint's meta records (its user_config)
MODEL = "model"  # shapes the model: compared as the model config (jaxchat.checkpoint.meta.check_compatible)
# or changes the maths through a value it resolves to, which is compared instead (-1, automatic, and the number it
# resolves to are one run): the meta records each under its name (jaxchat.train.run.Run.resolved)
BATCH, HORIZON, DTYPE = "total_batch_size", "num_iterations", "compute_dtype"
RESOLVED = types.MappingProxyType({BATCH: "the total batch size", HORIZON: "the horizon in steps",
                                   DTYPE: "the compute dtype"})


def setting(default: Any, help: str, group: str, *, resume: str, nanochat: bool = True,
            choices: Sequence | None = None, positive: bool = False, off: str | None = None, parse: Any = None,
            recipes: Sequence[str] | None = None, cli: bool = True) -> Any:
    """A RunSettings field: default and command-line metadata. resume: how a resumed run's value is compared
    with its checkpoint's (FREE, SAME, MODEL or a key of RESOLVED: every field says); nanochat: base_train.py
    has this flag (the README's nanochat column); choices/positive: checked by RunSettings.check; off: -1 means
    this ('off', 'all'), as nanochat's flags say, and any other value below 1 is refused (`--num-iterations 0`
    is a typo, not a way to fall through to another horizon); parse: the argparse type when the annotation is
    not enough; recipes: the recipes that have this setting (None: every one); cli: False for settings of
    library callers only."""
    return dataclasses.field(default=default, metadata={
        "help": help, "group": group, "resume": resume, "nanochat": nanochat, "choices": choices,
        "positive": positive, "off": off, "parse": parse, "recipes": recipes, "cli": cli})


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The settings of a training run: base_train.py's flags (same names and meanings) and jaxchat's own
    (group JAX). Checked when built: an instance is a run that can start."""

    # Logging
    run: str = setting("dummy", "wandb run name ('dummy' disables wandb logging)", "Logging", resume=FREE)
    # Runtime
    device_type: str = setting("", "cuda|cpu (empty = autodetect)", "Runtime", resume=DTYPE)
    recipe: str = setting(DEFAULT_RECIPE, f"nanochat recipe: {', '.join(RECIPES)}", "Runtime", nanochat=False,
                          resume=SAME)
    # FP8 training
    fp8: bool = setting(False, "enable FP8 training (fast on H100+; emulated, slow, on CPU)", "FP8 training",
                        resume=SAME)
    fp8_recipe: str = setting("tensorwise", "FP8 scaling recipe: tensorwise (one scale per tensor, as nanochat's "
                              "own fp8.py; rowwise is refused)", "FP8 training", resume=SAME)
    # Model architecture
    depth: int = setting(20, "depth of the Transformer model", "Model architecture", positive=True, resume=MODEL)
    aspect_ratio: int = setting(64, "model_dim = depth * aspect_ratio", "Model architecture", positive=True,
                                resume=MODEL)
    head_dim: int = setting(128, "target head dimension for attention", "Model architecture", positive=True,
                            resume=MODEL)
    max_seq_len: int = setting(2048, "max context length", "Model architecture", positive=True, resume=MODEL)
    window_pattern: str = setting("SSSL", "sliding window pattern tiled across layers: L=full, S=half context "
                                  "(e.g. 'SSL')", "Model architecture", resume=MODEL)
    # Training horizon (only one used, in order of precedence)
    num_iterations: int = setting(-1, "explicit number of optimization steps (-1 = disable)", "Training horizon",
                                  off="off", resume=HORIZON)
    target_flops: float = setting(-1.0, "calculate num_iterations to reach target_flops (-1 = disable)",
                                  "Training horizon", off="off", resume=HORIZON)
    target_param_data_ratio: float = setting(8, "calculate num_iterations to maintain data:param ratio "
                                             "(Chinchilla=20, -1 = disable)", "Training horizon", off="off",
                                             resume=HORIZON)
    # Optimization
    device_batch_size: int = setting(32, "per-device batch size", "Optimization", positive=True, resume=FREE)
    total_batch_size: int = setting(524288, "total batch size in tokens (-1 = the recipe's rule, where it has one)",
                                    "Optimization", resume=BATCH)
    embedding_lr: float = setting(0.3, "learning rate for embedding parameters (Adam)", "Optimization", resume=SAME)
    unembedding_lr: float = setting(0.004, "learning rate for unembedding parameters (Adam)", "Optimization",
                                    resume=SAME)
    weight_decay: float = setting(0.2, "cautious weight decay for the Muon optimizer (for weights)", "Optimization",
                                  resume=SAME)
    matrix_lr: float = setting(0.02, "learning rate for matrix parameters (Muon)", "Optimization", resume=SAME)
    scalar_lr: float = setting(0.5, "learning rate for scalars (resid_lambdas, x0_lambdas)", "Optimization",
                               resume=SAME)
    adam_beta1: float = setting(0.8, "Adam beta1 for embedding/unembedding", "Optimization", resume=SAME)
    adam_beta2: float = setting(0.95, "Adam beta2 for embedding/unembedding", "Optimization", resume=SAME)
    warmup_ratio: float = setting(0.0, "ratio of iterations for LR warmup", "Optimization", resume=SAME)
    warmup_steps: int = setting(0, "number of steps for LR warmup", "Optimization", recipes=("92d63d4",), resume=SAME)
    warmdown_ratio: float = setting(0.4, "ratio of iterations for LR warmdown", "Optimization", resume=SAME)
    final_lr_frac: float = setting(0.0, "final LR as fraction of initial LR", "Optimization", resume=SAME)
    resume_from_step: int | str = setting(-1, "resume training from this step (-1 = disable, 'latest' = newest "
                                          "complete checkpoint, or a fresh start if there is none)", "Optimization",
                                          parse=parse_resume_step, resume=FREE)
    init_from: str | None = setting(None, "start a new run from these weights: a jaxchat run directory (its newest "
                                    "step) or step directory, or nanochat's model_<step>.pt with its meta_<step>.json "
                                    "beside it; optimizer, schedule, data and step start anew", "Optimization",
                                    nanochat=False, resume=FREE)
    # Evaluation
    eval_every: int = setting(250, "evaluate val bpb every N steps (-1 = disable)", "Evaluation", off="off",
                              resume=FREE)
    eval_tokens: int = setting(20 * 524288, "number of tokens to evaluate val loss on", "Evaluation", resume=FREE)
    core_metric_every: int = setting(2000, "evaluate CORE metric every N steps (-1 = disable)", "Evaluation",
                                     off="off", resume=FREE)
    core_metric_max_per_task: int = setting(500, "examples per task for CORE metric", "Evaluation", resume=FREE)
    sample_every: int = setting(2000, "sample from model every N steps (-1 = disable)", "Evaluation", off="off",
                                resume=FREE)
    save_every: int = setting(-1, "save checkpoints every N steps (-1 = only at end)", "Evaluation", off="off",
                              resume=FREE)
    # Output
    model_tag: str | None = setting(None, "override model tag for checkpoint directory name", "Output", resume=FREE)
    overwrite: bool = setting(False, "replace the checkpoints of an earlier run under this model tag, or with "
                              "--resume-from-step N the steps newer than N (set aside, deleted once this run's first "
                              "checkpoint is complete)", "Output", nanochat=False, resume=FREE)
    no_lock: bool = setting(False, "write the run directory without its lock, on filesystems that have none (then make "
                            "sure that one run writes there at a time)", "Output", nanochat=False, resume=FREE)
    # JAX only
    num_devices: int = setting(-1, "devices in the mesh, over all processes (-1 = all)", "JAX", nanochat=False,
                               off="all", resume=FREE)
    fsdp: bool = setting(False, "shard parameters over the data axis too (ZeRO-3), for depths whose state does "
                         "not fit", "JAX", nanochat=False, resume=FREE)
    data_dir: str | None = setting(None, "parquet shards (default: the recipe corpus's, <base_dir>/base_data or "
                                   "<base_dir>/base_data_climbmix)", "JAX", nanochat=False, resume=FREE)
    seed: int = setting(42, "seed of the model initialisation", "JAX", nanochat=False, resume=FREE)
    keep_checkpoints: int = setting(-1, "keep only the newest N checkpoints (-1 = all)", "JAX", nanochat=False,
                                    off="all", resume=FREE)
    attention: str = setting("auto", "attention kernel (auto: splash on TPUs, cudnn on NVIDIA GPUs, "
                             "xla elsewhere)", "JAX", nanochat=False, choices=("auto", "cudnn", "splash", "xla"),
                             resume=FREE)
    heartbeat_timeout: int = setting(HEARTBEAT_TIMEOUT_S, "seconds without a heartbeat after which the coordination "
                                     "service declares a process of a multi-process run lost and ends the others",
                                     "JAX", nanochat=False, positive=True, resume=FREE)
    profile_steps: str | None = setting(None, "trace steps A..B-1 (A:B, as a Python slice) with jax.profiler into "
                                        "<base_dir>/profiles/<model_tag>, for XProf or Perfetto (jaxchat.train.profiling)",
                                        "JAX", nanochat=False, resume=FREE)
    loader_workers: int = setting(4, "threads reading and tokenising data", "JAX", nanochat=False, resume=FREE)
    remat: str = setting("auto", "what each block keeps for the backward pass: everything, matmul outputs, or its "
                         "input only (auto: on a GPU or TPU each compiled, and the fastest whose peak leaves 10% of the "
                         "device free, by XLA:TPU's prediction on a TPU, the cheapest on a GPU, "
                         "jaxchat.compiled.remat_choice; on the CPU the first of none, dots, block whose "
                         "estimated memory fits, jaxchat.model.footprint)", "JAX", nanochat=False, choices=("auto", *REMAT_POLICIES), resume=FREE)
    loss_chunk_len: int = setting(128, "positions per chunk of the loss head (float32 logits of one chunk at a "
                                  "time)", "JAX", nanochat=False, positive=True, resume=FREE)
    compilation_cache: str | None = setting(None, COMPILATION_CACHE_HELP, "JAX", nanochat=False, resume=FREE)
    # library callers only (the benchmarks): None is bfloat16 on accelerators, float32 on CPU
    compute_dtype: str | None = setting(None, "compute dtype of the model", "JAX", nanochat=False, cli=False,
                                        resume=DTYPE)
    # set by jaxchat.train.run.build_run when it resolves --remat auto: what was asked, beside what runs (remat)
    remat_asked: str | None = setting(None, "the --remat asked when it was resolved", "JAX", nanochat=False, cli=False,
                                      resume=FREE)

    def __post_init__(self):
        self.check()

    @classmethod
    def for_recipe(cls, recipe: str = DEFAULT_RECIPE, **values: Any) -> "RunSettings":
        """The settings of `recipe`: its defaults, then `values` (which must be settings the recipe has)."""
        chosen = get_recipe(recipe)
        for name in values:
            _check_recipe_has(chosen, name)
        return cls(**{**chosen.defaults, **values, "recipe": recipe})

    def check(self) -> None:
        """The one checker: raises SettingsError naming the flag to change."""
        get_recipe(self.recipe)
        for field in dataclasses.fields(self):
            value, meta = getattr(self, field.name), field.metadata
            if meta["positive"] and value < 1:
                raise SettingsError(f"{flag_name(field.name)} must be a positive integer, got {value}")
            if meta["off"] is not None and value != -1 and value < 1:
                raise SettingsError(f"{flag_name(field.name)} {value}: -1 means {meta['off']}, any other value must "
                                    "be at least 1")
            if meta["choices"] is not None and value not in meta["choices"]:
                raise SettingsError(f"{flag_name(field.name)} {value!r}: use one of {', '.join(meta['choices'])}")
        if self.total_batch_size < 1 and not (self.total_batch_size == -1 and self.recipe_spec.auto_batch):
            auto = [name for name, recipe in RECIPES.items() if recipe.auto_batch]
            raise SettingsError(f"--total-batch-size must be a positive number of tokens, got {self.total_batch_size} "
                                f"(-1, automatic, is a setting of recipe(s) {', '.join(auto)} only)")
        if self.model_tag is not None:
            try:
                check_model_tag(self.model_tag)
            except ValueError as e:
                raise SettingsError(f"--model-tag: {e}") from None
        if self.warmup_steps < 0:
            raise SettingsError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.num_iterations == self.target_flops == self.target_param_data_ratio == -1:
            raise SettingsError("no training horizon: set --num-iterations, --target-flops or --target-param-data-ratio")
        if self.fp8_recipe not in FP8_RECIPES:
            raise SettingsError(f"--fp8-recipe {self.fp8_recipe!r} is not supported: only 'tensorwise' (one scale per "
                                "tensor), as nanochat's own fp8.py; rowwise needs the full torchao library there")
        if self.overwrite and self.resume_from_step == LATEST:
            raise SettingsError("--overwrite with --resume-from-step latest: 'latest' continues from the newest step, "
                                "which replaces nothing; --overwrite is for a new run, or for resuming an older step "
                                "(--resume-from-step N), whose newer steps it sets aside")
        if self.init_from and self.resume_from_step not in (-1, LATEST):
            raise SettingsError(f"--init-from starts a new run from given weights and --resume-from-step "
                                f"{self.resume_from_step} continues this one: pass one of them (with --resume-from-step "
                                "latest, --init-from applies to a requeued job's first start only)")
        if self.profile_steps is not None:
            try:
                parse_profile_steps(self.profile_steps)
            except ProfileStepsError as e:
                raise SettingsError(str(e)) from None
        try:
            check_window_pattern(self.window_pattern)
        except ValueError as e:
            raise SettingsError(f"--window-pattern: {e}") from None
        try:
            width_and_heads(self.depth, self.aspect_ratio, self.head_dim, self.recipe)
        except ValueError as e:  # the message names the flags
            raise SettingsError(str(e)) from None

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """--profile-steps as (A, B), the steps A..B-1, or None."""
        return None if self.profile_steps is None else parse_profile_steps(self.profile_steps)

    @property
    def recipe_spec(self) -> Recipe:
        return RECIPES[self.recipe]

    @property
    def corpus_dir(self) -> str:
        """--data-dir, else the recipe's corpus's directory (<base_dir>/base_data, .../base_data_climbmix)."""
        return get_data_dir(self.data_dir, self.recipe_spec.corpus)

    def recipe_has(self, name: str) -> bool:
        """Whether this run's recipe has the setting `name` (e.g. for the report: warmup_ratio or warmup_steps)."""
        try:
            _check_recipe_has(self.recipe_spec, name)
        except SettingsError:
            return False
        return True

    def model_kwargs(self) -> dict:
        """GPT keyword arguments: the JAX-only model settings (the recipe's model is GPTConfig.recipe)."""
        import jax.numpy as jnp

        kwargs = {"remat": self.remat, "loss_chunk_len": self.loss_chunk_len}
        if self.attention != "auto":
            kwargs["attention_implementation"] = self.attention
        if self.compute_dtype:
            kwargs["dtype"] = jnp.dtype(self.compute_dtype)
        if self.fp8:
            kwargs["fp8"] = True
        return kwargs

    def user_config(self) -> dict:
        """The command-line settings by name: what a run logs (wandb, checkpoint meta, report)."""
        config = {f.name: getattr(self, f.name) for f in cli_fields()}
        if self.remat_asked is not None:  # --remat auto, resolved: remat is the policy that ran
            config["remat_asked"] = self.remat_asked
        return config


# ---- the command line, generated --------------------------------------------------------------------

def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(RunSettings) if f.metadata["cli"]]


def _argparse_type(field: dataclasses.Field):
    if field.metadata["parse"] is not None:
        return field.metadata["parse"]
    if isinstance(field.type, types.UnionType):  # X | None: an optional X
        return next(t for t in field.type.__args__ if t is not type(None))
    return field.type


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per RunSettings field, in its group. Their defaults are SUPPRESSed, so that a parse holds
    only the flags given (the recipe fills the rest: settings_from_flags); --help shows the default of the
    default recipe."""
    groups: dict[str, Any] = {}
    for field in cli_fields():
        group = groups.setdefault(field.metadata["group"], parser.add_argument_group(field.metadata["group"]))
        # (argparse %-formats help texts: a bare % in one, "10% of", made --help raise TypeError)
        help_text = f"{field.metadata['help']} (default: {field.default!r})".replace("%", "%%")
        if field.metadata["recipes"] is not None:
            help_text += f"; recipes {', '.join(field.metadata['recipes'])} only"
        if field.type is bool:
            group.add_argument(flag_name(field.name), action="store_true", default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag_name(field.name), type=_argparse_type(field), choices=field.metadata["choices"],
                               default=argparse.SUPPRESS, help=help_text)


def build_parser(description: str = "Pretrain base model") -> argparse.ArgumentParser:
    """scripts.train's command line: the settings' flags and nothing else."""
    parser = argparse.ArgumentParser(description=description)
    add_setting_flags(parser)
    return parser


def _check_recipe_has(recipe: Recipe, name: str) -> None:
    if name in recipe.replaced:
        raise SettingsError(f"{flag_name(name)} is not a setting of recipe {recipe.name}: {recipe.replaced[name]}")
    owners = RunSettings.__dataclass_fields__[name].metadata["recipes"]
    if owners is not None and recipe.name not in owners:
        raise SettingsError(f"{flag_name(name)} is not a setting of recipe {recipe.name}: it belongs to recipe(s) "
                            f"{', '.join(owners)} (--recipe)")


def resume_difference(meta: dict, settings: RunSettings, resolved: Mapping[str, Any]) -> str | None:
    """How a resumed run (`settings`, resolving to `resolved`: jaxchat.train.run.Run.resolved) differs in its maths from
    the run that saved a checkpoint (its meta): the first difference, as 'what: the checkpoint's X, this run's Y',
    or None. The model's settings are check_compatible's. A checkpoint saved before a resolved value was recorded
    is compared on what it holds: the flag of the same name, where it was given (not -1, automatic)."""
    saved = meta.get("user_config") or {}
    for field in dataclasses.fields(settings):
        ours = getattr(settings, field.name)
        if field.metadata["resume"] == SAME and field.name in saved and saved[field.name] != ours:
            return f"{flag_name(field.name)}: the checkpoint's {saved[field.name]!r}, this run's {ours!r}"
    for name, what in RESOLVED.items():
        theirs = meta.get(name)
        if theirs is None and saved.get(name, -1) != -1:
            theirs = saved[name]
        if theirs is not None and theirs != resolved[name]:
            return f"{what} ({_resolved_from(name)}): the checkpoint's {theirs}, this run's {resolved[name]}"
    if meta["step"] > resolved[HORIZON]:  # a checkpoint that records no horizon (the others differ above)
        return f"step {meta['step']} is past this run's horizon of {resolved[HORIZON]} steps ({_resolved_from(HORIZON)})"
    return None


def _resolved_from(name: str) -> str:
    return "from " + ", ".join(flag_name(f.name) for f in cli_fields() if f.metadata["resume"] == name)


def settings_from_flags(namespace: argparse.Namespace) -> RunSettings:
    """The checked settings of a parse by a parser with add_setting_flags (other attributes are ignored):
    field defaults, then the recipe's, then the flags given. Raises SettingsError."""
    names = {field.name for field in cli_fields()}
    given = {name: value for name, value in vars(namespace).items() if name in names}
    return RunSettings.for_recipe(given.pop("recipe", DEFAULT_RECIPE), **given)


def parse_settings(argv: list[str] | None = None) -> RunSettings:
    """The checked settings of a command line. Raises SettingsError (argparse itself exits on a malformed flag)."""
    return settings_from_flags(build_parser().parse_args(argv))
