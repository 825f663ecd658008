"""The settings are the one source of every training flag: the command line, the README's table, the CPU
demo and the library's keyword defaults agree with them; recipes are data; bad input is one clear line."""

import dataclasses
import inspect
import os
import re

import pytest

from jaxchat.train import settings as settings_module
from jaxchat.data.loader import make_train_loader
from jaxchat.model.gpt import GPTConfig
from jaxchat.optim.recipes import setup_optimizer
from jaxchat.train.settings import (DEFAULT_RECIPE, FREE, MODEL, RESOLVED, SAME, Recipe, RunSettings, SettingsError,
                              cli_fields, flag_name, parse_settings, resume_difference)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path: str) -> str:
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_no_flags_give_the_field_defaults_and_flags_parse_to_their_types():
    assert parse_settings([]) == RunSettings()
    parsed = parse_settings(["--depth=4", "--target-flops=1e18", "--resume-from-step", "latest", "--fsdp",
                             "--model-tag=x", "--matrix-lr=0.64"])
    assert (parsed.depth, parsed.target_flops, parsed.resume_from_step, parsed.fsdp, parsed.model_tag) == \
        (4, 1e18, "latest", True, "x")
    assert type(parsed.depth) is int and type(parsed.target_flops) is float
    assert parsed.matrix_lr == float("0.64")  # the same float argparse always made of the text


def test_readme_table_has_every_flag_with_its_default():
    """The README's table: one row per flag, its default cell starting with the field's default (a default
    computed at run time, None or '', is described in words), '-' in the nanochat column iff jaxchat's own."""
    rows = re.findall(r"^\| `(--[a-z0-9-]+)` \| (.+?) \| (.+?) \| .+ \|$", read("README.md"), re.M)
    fields = {flag_name(f.name): f for f in cli_fields()}
    assert sorted(flag for flag, _, _ in rows) == sorted(fields)
    for flag, default_cell, nanochat_cell in rows:
        field = fields[flag]
        assert (nanochat_cell == "-") == (not field.metadata["nanochat"]), flag
        first = default_cell.strip("`").split()[0].strip("`")
        if field.default is False:
            assert first == "off", flag
        elif field.default not in (None, ""):
            typed = type(field.default)(first)
            assert typed == field.default, f"{flag}: README says {first}, settings {field.default!r}"


def demo_train_flags() -> dict[str, str]:
    """{flag: value as written} of runs/cpu_demo.sh's scripts.train command."""
    script = read("runs/cpu_demo.sh").replace("\\\n", " ")
    command = next(line for line in script.splitlines() if "-m scripts.train" in line)
    return dict(re.findall(r"(--[a-z0-9-]+)=(\"[^\"]*\"|\S+)", command))


def test_cpu_demo_flags_are_settings_and_its_scaled_rates_start_from_the_defaults():
    """The demo passes only known flags, and each learning rate as `$(lr X)`, the default X rescaled to its
    batch: X must be the setting's default, so a changed default changes the demo with it."""
    flags = demo_train_flags()
    known = {flag_name(f.name): f for f in cli_fields()}
    assert set(flags) <= set(known), set(flags) - set(known)
    scaled = {flag: value for flag, value in flags.items() if value.startswith('"$(lr')}
    assert set(scaled) == {"--matrix-lr", "--embedding-lr", "--unembedding-lr", "--scalar-lr"}
    for flag, value in scaled.items():
        written = float(re.fullmatch(r'"\$\(lr ([\d.]+)\)"', value).group(1))
        assert written == known[flag].default, flag
    # and the reference batch of lr() is base_train.py's 2^19 (its learning rates' batch)
    assert "sqrt(524288 / batch)" in read("runs/cpu_demo.sh")


def test_library_keyword_defaults_are_the_settings():
    """setup_optimizer, GPTConfig.from_depth and make_train_loader keep keyword defaults for library callers:
    they must be the settings' (a test, so that a default changed in one place fails here, not drifts)."""
    optimizer_defaults = {name: p.default for name, p in inspect.signature(setup_optimizer).parameters.items()
                          if p.default is not inspect.Parameter.empty and name not in ("mesh", "print_fn", "horizon")}
    defaults = RunSettings()
    expected = {name: getattr(defaults, name) for name in optimizer_defaults if name != "adam_betas"}
    expected["adam_betas"] = (defaults.adam_beta1, defaults.adam_beta2)
    assert optimizer_defaults == expected
    depth_defaults = {name: p.default for name, p in inspect.signature(GPTConfig.from_depth).parameters.items()
                      if p.default is not inspect.Parameter.empty}
    assert depth_defaults == {name: getattr(defaults, name) for name in depth_defaults}
    assert inspect.signature(make_train_loader).parameters["workers"].default == defaults.loader_workers


@pytest.mark.parametrize("argv, message", [
    (["--recipe=nope"], "--recipe 'nope' is not a recipe: use one of bdcc030"),
    (["--window-pattern=SXL"], "--window-pattern: window_pattern 'SXL' must be made of S"),
    (["--device-batch-size=0"], "--device-batch-size must be a positive integer, got 0"),
    (["--num-iterations=-1", "--target-param-data-ratio=-1"], "no training horizon"),
    (["--depth=1", "--aspect-ratio=3"], "odd head size 3"),
])
def test_bad_settings_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(SettingsError) as error:
        parse_settings(argv)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_recipe_is_data_its_defaults_apply_and_flags_it_lacks_are_refused(monkeypatch):
    """A second recipe as the next one will be added: one table entry (named after a GPT of jaxchat.model.gpt.RECIPES). Its defaults replace the field
    defaults, the flags given win over both, and a flag it does not have gets the line saying what replaced it."""
    later = Recipe(name="92d63d4", nanochat_commit="92d63d4", defaults={"weight_decay": 0.28, "warmdown_ratio": 0.65},
                   replaced={"adam_beta1": "its AdamW betas are fixed per group"})
    monkeypatch.setattr(settings_module, "RECIPES", {DEFAULT_RECIPE: settings_module.RECIPES[DEFAULT_RECIPE],
                                                     "92d63d4": later})
    chosen = parse_settings(["--recipe=92d63d4", "--warmdown-ratio=0.5"])
    assert (chosen.recipe, chosen.weight_decay, chosen.warmdown_ratio) == ("92d63d4", 0.28, 0.5)
    assert parse_settings(["--adam-beta1=0.9"]).adam_beta1 == 0.9  # the default recipe has it
    with pytest.raises(SettingsError, match=r"^--adam-beta1 is not a setting of recipe 92d63d4: its AdamW betas"):
        parse_settings(["--recipe=92d63d4", "--adam-beta1=0.9"])
    with pytest.raises(SettingsError, match="use one of bdcc030, 92d63d4"):
        parse_settings(["--recipe=other"])


def test_a_setting_of_some_recipes_only_is_refused_by_the_others(monkeypatch):
    """A field whose metadata names its recipes (as 92d63d4's warmup_steps will) is refused by the others."""
    field = RunSettings.__dataclass_fields__["seed"]
    monkeypatch.setattr(field, "metadata", {**field.metadata, "recipes": ("later",)})
    with pytest.raises(SettingsError, match="--seed is not a setting of recipe bdcc030: it belongs to recipe"):
        parse_settings(["--seed=1"])


def test_settings_are_checked_when_built_even_by_library_callers():
    with pytest.raises(SettingsError, match="--remat 'all': use one of auto, none, dots, block"):
        RunSettings(remat="all")
    assert dataclasses.replace(RunSettings(), depth=4).depth == 4


def test_every_setting_says_how_a_resume_compares_it_and_the_readme_lists_them():
    """Each field is classified (FREE, SAME, MODEL or a resolved value), and the README's two lists under Training
    flags are exactly the command line's flags of each kind."""
    for field in dataclasses.fields(RunSettings):
        assert field.metadata["resume"] in (FREE, SAME, MODEL, *RESOLVED), field.name
    readme = read("README.md").split("## Training flags")[1].split("\n## ")[0]
    listed = {kind: re.search(rf"^- {kind} on resume\b(.*?)(?=^- |^$)", readme, re.M | re.S).group(1)
              for kind in ("kept", "free to change")}
    listed = {kind: sorted(re.findall(r"`(--[a-z0-9-]+)`", text.split(": ", 1)[1])) for kind, text in listed.items()}
    fields = cli_fields()
    assert listed["kept"] == sorted(flag_name(f.name) for f in fields if f.metadata["resume"] != FREE)
    assert listed["free to change"] == sorted(flag_name(f.name) for f in fields if f.metadata["resume"] == FREE)


def saved_meta(settings: RunSettings, step: int = 6, **resolved) -> dict:
    """A checkpoint's meta as scripts.train saves it (the parts resume_difference reads)."""
    return {"step": step, "user_config": settings.user_config(), **resolved}


SAVED = RunSettings(total_batch_size=1024, num_iterations=6, matrix_lr=0.02)
RESOLVED_SAVED = {"total_batch_size": 1024, "num_iterations": 6, "compute_dtype": "float32"}


@pytest.mark.parametrize("changed, resolved, difference", [
    ({}, {}, None),
    # the maths: a batch, a horizon extended after the last step or cut before the checkpoint, a rate, the dtype
    ({"total_batch_size": 2048}, {"total_batch_size": 2048},
     "the total batch size (from --total-batch-size): the checkpoint's 1024, this run's 2048"),
    ({"num_iterations": 10}, {"num_iterations": 10}, "the horizon in steps (from --num-iterations, --target-flops, "
                                                     "--target-param-data-ratio): the checkpoint's 6, this run's 10"),
    ({"num_iterations": 4}, {"num_iterations": 4}, "the horizon in steps (from --num-iterations, --target-flops, "
                                                   "--target-param-data-ratio): the checkpoint's 6, this run's 4"),
    ({"matrix_lr": 0.04}, {}, "--matrix-lr: the checkpoint's 0.02, this run's 0.04"),
    ({"warmdown_ratio": 0.5}, {}, "--warmdown-ratio: the checkpoint's 0.4, this run's 0.5"),
    ({"device_type": "cuda"}, {"compute_dtype": "bfloat16"},
     "the compute dtype (from --device-type): the checkpoint's float32, this run's bfloat16"),
    # resolved values compare, not flags: a horizon from the data:param ratio that gives the same steps, the
    # automatic batch's number given explicitly, another device type of the same dtype
    ({"num_iterations": -1, "target_param_data_ratio": 9.5}, {}, None),
    ({"device_type": "cpu"}, {}, None),
    # what changes no maths
    ({"device_batch_size": 4, "eval_every": 1, "save_every": 2, "sample_every": -1, "remat": "block", "seed": 7,
      "attention": "xla", "num_devices": 1, "loader_workers": 1, "model_tag": "x", "resume_from_step": "latest",
      "fsdp": True, "run": "wandb"}, {}, None),
])
def test_a_resume_is_compared_on_what_changes_the_maths(changed, resolved, difference):
    ours = dataclasses.replace(SAVED, **changed)
    assert resume_difference(saved_meta(SAVED, **RESOLVED_SAVED), ours, {**RESOLVED_SAVED, **resolved}) == difference


def test_a_checkpoint_from_before_the_resolved_values_is_compared_on_what_it_holds():
    """No resolved values recorded: a batch or horizon given as a flag is its own resolved value; an automatic one
    (-1) is not compared, nor a flag its user_config lacks; a step past this run's horizon is refused all the same."""
    old = saved_meta(SAVED)
    assert resume_difference(old, SAVED, RESOLVED_SAVED) is None
    assert resume_difference(old, SAVED, {**RESOLVED_SAVED, "total_batch_size": 512}) == \
        "the total batch size (from --total-batch-size): the checkpoint's 1024, this run's 512"
    by_ratio = RunSettings(total_batch_size=1024)  # the horizon from the data:param ratio (num_iterations -1)
    older = {**saved_meta(by_ratio), "user_config": {k: v for k, v in by_ratio.user_config().items() if k != "warmup_steps"}}
    assert resume_difference(older, dataclasses.replace(by_ratio, num_iterations=8), {**RESOLVED_SAVED,
                                                                                     "num_iterations": 8}) is None
    assert resume_difference(older, dataclasses.replace(by_ratio, num_iterations=4), {**RESOLVED_SAVED,
                                                                                     "num_iterations": 4}) == \
        ("step 6 is past this run's horizon of 4 steps (from --num-iterations, --target-flops, "
         "--target-param-data-ratio)")
