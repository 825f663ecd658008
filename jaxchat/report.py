"""The report card: each stage of a run logs a markdown section under <base_dir>/report/.

`python -m jaxchat.report generate` assembles them into report.md; `reset` starts a new one.
"""

import argparse
import datetime
import os
import re
from typing import Any

from jaxchat.common import get_base_dir


def _slug(section: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


class Report:
    def __init__(self, report_dir: str):
        self.report_dir = report_dir
        os.makedirs(report_dir, exist_ok=True)

    def log(self, section: str, data: list[dict | str]) -> str:
        """Write one section: a list of dicts (rendered as `- key: value` lines) and markdown strings."""
        path = os.path.join(self.report_dir, f"{_slug(section)}.md")
        lines = [f"## {section}", f"timestamp: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}", ""]
        for item in data:
            if isinstance(item, dict):
                lines += [f"- {key}: {_format_value(value)}" for key, value in item.items()]
            elif item:
                lines.append(str(item))
            lines.append("")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
        return path

    def sections(self) -> list[str]:
        names = sorted(n for n in os.listdir(self.report_dir) if n.endswith(".md") and n != "report.md")
        return [os.path.join(self.report_dir, n) for n in names]

    def generate(self) -> str:
        path = os.path.join(self.report_dir, "report.md")
        parts = ["# jaxchat report", f"generated: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}", ""]
        for section in sorted(self.sections(), key=os.path.getmtime):
            with open(section, encoding="utf-8") as f:
                parts.append(f.read())
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(parts))
        return path

    def reset(self) -> None:
        for path in self.sections():
            os.remove(path)


def get_report(base_dir: str | None = None) -> Report:
    return Report(os.path.join(base_dir or get_base_dir(), "report"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Assemble or reset the jaxchat report card")
    parser.add_argument("command", choices=["generate", "reset"])
    args = parser.parse_args(argv)
    report = get_report()
    if args.command == "generate":
        print(f"Report written to {report.generate()}")
    else:
        report.reset()
        print(f"Report sections in {report.report_dir} removed")


if __name__ == "__main__":
    main()
