"""The report card of a run, under <base_dir>/report/.

Each stage writes its own section (`get_report().log(section, data)`): <slug>.md to read and <slug>.json
with the same data, from which the summary is built. Training also appends its loss and validation bpb to
its run's own curve, training_curve_<model tag>.csv, as it goes: a resumed run continues its curve, and a
run under another model tag leaves it alone. `generate` draws the curve of the run that wrote the base
training section.

    python -m jaxchat.report reset       start a new report: clear the sections, log the system section
    python -m jaxchat.report generate    assemble report.md: summary table, curve (PNG), system, stages
"""

import argparse
import csv
import datetime
import importlib.metadata
import io
import json
import os
import platform
import re
import socket
import subprocess
from collections.abc import Iterable
from typing import Any

from jaxchat import storage
from jaxchat.common import get_base_dir

REPORT_SUBDIR = "report"  # under a base dir, as nanochat's


def slugify(section: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
REPORT_FILE = "report.md"
CURVE_PREFIX = "training_curve"
CURVE_FIELDS = ("step", "train_loss", "val_bpb")


def curve_file(model_tag: str, ext: str = "csv") -> str:
    """The name of a run's curve in the report directory: training_curve_<model tag>.csv (the data) or .png."""
    return f"{CURVE_PREFIX}_{model_tag}.{ext}"


class Section:
    """The sections the scripts log, in the order a run goes through them."""

    SYSTEM = "System"  # logged by `reset`: its timestamp starts the wall clock
    TOKENIZER_TRAINING = "Tokenizer training"
    TOKENIZER_EVALUATION = "Tokenizer evaluation"
    BASE_TRAINING = "Base model training"
    BASE_LOSS = "Base model loss"
    BASE_EVALUATION = "Base model evaluation"


class Label:
    """The keys of the figures a script logs and the summary reads back: one spelling for both."""

    VOCAB_SIZE = "Vocabulary size"
    VAL_BYTES_PER_TOKEN = "val bytes/token"
    PARAMETERS = "Number of parameters"
    DEVICES = "Devices"
    TRAINING_TOKENS = "Number of training tokens"
    TOKENS_PER_PARAM = "Tokens : Params ratio"
    TRAINING_TIME = "Total training time"
    TOK_PER_SEC = "Average tok/sec"
    MFU = "MFU %"
    PEAK_MEMORY = "Peak memory usage"
    MIN_VAL_BPB = "Minimum validation bpb"
    TRAIN_BPB = "train bpb"
    VAL_BPB = "val bpb"
    CORE_TRAINING = "CORE metric estimate"
    CORE = "CORE metric"


# The stages in the order a run goes through them; sections with other names follow, oldest first.
STAGE_ORDER = [slugify(section) for section in (Section.SYSTEM, Section.TOKENIZER_TRAINING, Section.TOKENIZER_EVALUATION,
                                                Section.BASE_TRAINING, Section.BASE_LOSS, Section.BASE_EVALUATION)]
# (label in the summary, section, key in that section's data): the figures that say how the run went.
SUMMARY_FIGURES = [
    ("Vocabulary size", Section.TOKENIZER_TRAINING, Label.VOCAB_SIZE),
    ("Tokenizer bytes/token (val)", Section.TOKENIZER_EVALUATION, Label.VAL_BYTES_PER_TOKEN),
    ("Parameters", Section.BASE_TRAINING, Label.PARAMETERS),
    ("Devices", Section.BASE_TRAINING, Label.DEVICES),
    ("Training tokens", Section.BASE_TRAINING, Label.TRAINING_TOKENS),
    ("Tokens : params", Section.BASE_TRAINING, Label.TOKENS_PER_PARAM),
    ("Training time", Section.BASE_TRAINING, Label.TRAINING_TIME),
    ("Training tok/s", Section.BASE_TRAINING, Label.TOK_PER_SEC),
    ("MFU", Section.BASE_TRAINING, Label.MFU),
    ("Peak memory", Section.BASE_TRAINING, Label.PEAK_MEMORY),
    ("Min val bpb (training)", Section.BASE_TRAINING, Label.MIN_VAL_BPB),
    ("Train bpb", Section.BASE_LOSS, Label.TRAIN_BPB),
    ("Val bpb", Section.BASE_LOSS, Label.VAL_BPB),
    ("CORE (training)", Section.BASE_TRAINING, Label.CORE_TRAINING),
    ("CORE", Section.BASE_EVALUATION, Label.CORE),
]


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _render_item(key: str, value: Any) -> list[str]:
    text = _format_value(value)
    if "\n" not in text:
        return [f"- {key}: {text}"]
    # multi-line text (a sample) as a fenced block under its item, so the list stays a list
    return [f"- {key}:", "  ```", *(f"  {line}" for line in text.split("\n")), "  ```"]


def _plain(value: Any) -> Any:
    """A NumPy or JAX scalar as the Python number it holds, so the markdown and the JSON show the same."""
    return value.item() if getattr(value, "shape", None) == () else value


# -----------------------------------------------------------------------------
# The system section


def _run(command: list[str], cwd: str) -> str | None:
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_info() -> dict[str, str]:
    """Commit, branch and subject of the checkout this package runs from (not of the working directory)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = _run(["git", "rev-parse", "--short", "HEAD"], repo)
    if commit is None:
        return {"Git commit": "unknown (not running from a git checkout)"}
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    return {
        "Git commit": f"{commit}{' (uncommitted changes)' if dirty else ''}",
        "Git branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], repo) or "unknown",
        "Git subject": (_run(["git", "log", "-1", "--format=%s"], repo) or "")[:100],
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def system_info() -> dict[str, str]:
    """What the figures of this run depend on: software, devices, host, code version."""
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    limits = [(d.memory_stats() or {}).get("bytes_limit", 0) for d in jax.local_devices()]
    memory = _host_memory_gib()
    info = {
        "Host": f"{socket.gethostname()} ({platform.platform()})",
        "CPUs": f"{os.cpu_count()} logical" + (f", {memory:.1f} GiB memory" if memory else ""),
        "Load average (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a",
        "JAX backend": f"{jax.default_backend()}, {jax.process_count()} process(es)",
        "Devices": f"{len(devices)} x {', '.join(kinds)}",
        "Device memory": f"{min(limits) / 2**30:.1f} GiB each" if all(limits) and limits else "n/a",
        "Python": platform.python_version(),
        "Packages": ", ".join(f"{p} {_version(p)}" for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain")),
    }
    info.update(git_info())
    info["Base directory"] = get_base_dir()
    return info


# -----------------------------------------------------------------------------


class Report:
    """The report in `report_dir`, as the run `model_tag` writes it (scripts.train: its curve, and the tag in
    the records of its sections), or as any other stage does (model_tag None)."""

    def __init__(self, report_dir: str, model_tag: str | None = None):
        self.report_dir, self.model_tag = report_dir, model_tag
        storage.makedirs(report_dir)

    def path(self, name: str) -> str:
        return storage.join(self.report_dir, name)

    def _names(self) -> list[str]:
        """The report folder's files ([] before the first: in a bucket a folder exists once a file is in it)."""
        return storage.listdir(self.report_dir) if storage.isdir(self.report_dir) else []

    def log(self, section: str, data: list[dict | str]) -> str:
        """Write one section: a list of dicts (rendered as `- key: value` lines) and markdown strings, as
        <slug>.md and as the record {section, timestamp, data} in <slug>.json (values that JSON cannot hold
        as strings), with the model tag of a run's report. A stage that runs again replaces its section."""
        data = [{key: _plain(value) for key, value in item.items()} if isinstance(item, dict) else item
                for item in data]
        timestamp = f"{datetime.datetime.now():{TIME_FORMAT}}"
        record = {"section": section, "timestamp": timestamp, "data": data}
        if self.model_tag is not None:
            record["model_tag"] = self.model_tag
        storage.write_text(self.path(f"{slugify(section)}.json"), json.dumps(record, indent=1, default=str))
        lines = [f"## {section}", f"timestamp: {timestamp}", ""]
        for item in data:
            if isinstance(item, dict):
                for key, value in item.items():
                    lines += _render_item(key, value)
            elif item:
                lines.append(str(item))
            lines.append("")
        path = self.path(f"{slugify(section)}.md")
        storage.write_text(path, "\n".join(lines))
        return path

    # -- the training curve --------------------------------------------------------

    def _run_curve(self) -> str:
        if self.model_tag is None:
            raise ValueError("only a run's report has a curve: get_report(model_tag=...)")
        return self.path(curve_file(self.model_tag))

    def append_curve(self, rows: Iterable[tuple[int, float | None, float | None]]) -> None:
        """Append (step, train loss, val bpb) rows to this run's curve (None: not measured at that step)."""
        rows = list(rows)
        if not rows:
            return
        path = self._run_curve()
        text = io.StringIO()
        writer = csv.writer(text)
        if not storage.exists(path):
            writer.writerow(CURVE_FIELDS)
        writer.writerows([step, "" if loss is None else f"{loss:.6f}", "" if bpb is None else f"{bpb:.6f}"]
                         for step, loss, bpb in rows)
        storage.append_text(path, text.getvalue())

    def clear_curve(self) -> None:
        """A fresh training run starts a new curve (of its model tag: other runs' curves stay)."""
        for path in (self._run_curve(), self.path(curve_file(self.model_tag, "png"))):
            if storage.exists(path):
                storage.remove(path)

    def read_curve(self, model_tag: str) -> tuple[dict[int, float], dict[int, float]]:
        """Train loss and val bpb by step of a run's curve. A resumed run rewrites the steps after its
        checkpoint, and the newest row of a step wins."""
        train, val = {}, {}
        path = self.path(curve_file(model_tag))
        if not storage.exists(path):
            return train, val
        for row in csv.DictReader(io.StringIO(storage.read_text(path), newline="")):
                step = int(row["step"])
                if row["train_loss"]:
                    train[step] = float(row["train_loss"])
                if row["val_bpb"]:
                    val[step] = float(row["val_bpb"])
        return dict(sorted(train.items())), dict(sorted(val.items()))

    def plot_curve(self, model_tag: str) -> str | None:
        """Draw a run's curve, training_curve_<model tag>.png (train loss and val bpb against the step); None if
        nothing was logged."""
        train, val = self.read_curve(model_tag)
        if not train and not val:
            return None
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt

        fig, (ax_loss, ax_bpb) = plt.subplots(1, 2, figsize=(11, 4))
        ax_loss.plot(list(train), list(train.values()), lw=1.2, color="tab:blue")
        ax_loss.set(title="training loss (EMA, nats/token)", xlabel="step", ylabel="loss")
        ax_bpb.plot(list(val), list(val.values()), marker="o", lw=1.2, color="tab:orange")
        ax_bpb.set(title="validation bits per byte", xlabel="step", ylabel="bpb")
        for ax in (ax_loss, ax_bpb):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path, image = self.path(curve_file(model_tag, "png")), io.BytesIO()
        fig.savefig(image, format="png", dpi=110)
        plt.close(fig)
        storage.write_bytes(path, image.getvalue())
        return path

    # -- assembling ----------------------------------------------------------------

    def sections(self) -> list[str]:
        """The stage sections, in run order: known stages first, then any others oldest first."""
        names = [n for n in self._names() if n.endswith(".md") and n != REPORT_FILE]
        order = {f"{slug}.md": i for i, slug in enumerate(STAGE_ORDER)}
        names.sort(key=lambda n: (order.get(n, len(order)), storage.getmtime(self.path(n))))
        return [self.path(n) for n in names]

    def records(self) -> dict[str, dict]:
        """Each section's record as log wrote it ({section, timestamp, data}), by slug."""
        records = {}
        for name in self._names():
            if name.endswith(".json"):
                records[name[:-len(".json")]] = json.loads(storage.read_text(self.path(name)))
        return records

    def summary(self) -> list[tuple[str, str]]:
        """(figure, value) pairs from the sections' records, in SUMMARY_FIGURES order; figures a stage did
        not measure (None, "n/a") are left out. Last, the wall clock from `reset` to the newest section."""
        records = self.records()
        rows = []
        for label, section, key in SUMMARY_FIGURES:
            items = [item for item in records.get(slugify(section), {}).get("data", []) if isinstance(item, dict)]
            value = next((item[key] for item in items if key in item), None)
            if value not in (None, "n/a"):
                rows.append((label, _format_value(value)))
        stamps = {slug: datetime.datetime.strptime(r["timestamp"], TIME_FORMAT) for slug, r in records.items()}
        start = stamps.pop(slugify(Section.SYSTEM), None)
        if start and stamps:
            rows.append(("Wall clock, reset to last stage", str(max(stamps.values()) - start)))
        return rows

    def generate(self) -> str:
        """Write report.md: summary table and curve first, then the system section and each stage's."""
        parts = ["# jaxchat report", "", f"generated: {datetime.datetime.now():{TIME_FORMAT}}", "", "## Summary", ""]
        rows = self.summary()
        if rows:
            parts += ["| figure | value |", "| --- | --- |", *(f"| {label} | {value} |" for label, value in rows)]
        else:
            parts.append("(no stage has written its section yet)")
        trained = self.records().get(slugify(Section.BASE_TRAINING), {}).get("model_tag")
        if trained is not None and self.plot_curve(trained):  # the curve of the run whose section this is
            parts += ["", f"![training loss and validation bpb of {trained}]({curve_file(trained, 'png')})"]
        parts.append("")
        if not storage.exists(self.path(f"{slugify(Section.SYSTEM)}.md")):
            parts += ["## System", "(no `python -m jaxchat.report reset` before this run: taken now)", "",
                      *(f"- {key}: {value}" for key, value in system_info().items()), ""]
        parts += [storage.read_text(path) for path in self.sections()]
        storage.write_text(self.path(REPORT_FILE), "\n".join(parts))
        return self.path(REPORT_FILE)

    def reset(self) -> None:
        """Start a new report: remove every section, every run's curve and report.md, and log the system
        section (its timestamp starts the wall clock)."""
        for name in self._names():
            if name.endswith((".md", ".json")) or (name.startswith(CURVE_PREFIX) and name.endswith((".csv", ".png"))):
                storage.remove(self.path(name))
        self.log(Section.SYSTEM, [system_info()])


def get_report(base_dir: str | None = None, model_tag: str | None = None) -> Report:
    """<base_dir>/report, as the run `model_tag` writes it (None: any other stage)."""
    return Report(storage.join(base_dir or get_base_dir(), REPORT_SUBDIR), model_tag)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Reset or assemble the jaxchat report card")
    parser.add_argument("command", nargs="?", default="generate", choices=["generate", "reset"],
                        help="reset: start a new report; generate: write report.md (default)")
    parser.add_argument("--keep", action="store_true",
                        help="with reset: do nothing if a report was started (a requeued job's second start)")
    args = parser.parse_args(argv)
    report = get_report()
    if args.keep and storage.exists(report.path(f"{slugify(Section.SYSTEM)}.json")):
        print(f"Report in {report.report_dir} kept (started earlier)")
    elif args.command == "generate":
        path = report.generate()
        for label, value in report.summary():
            print(f"{label:<32} {value}")
        print(f"Report written to {path}")
    else:
        report.reset()
        print(f"New report in {report.report_dir}: system section written, earlier sections removed")


if __name__ == "__main__":
    main()
