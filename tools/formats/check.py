"""The round trip of every template in a folder (default: ../shared/templates), one line each:
the formats detected, and whether a reply with reasoning and one call, then two parallel calls,
reads back whole and fed a character at a time.

    python -m tools.formats.check [--dir DIR] [SUBSTRING]   # SUBSTRING: show that template's texts
"""

from __future__ import annotations

import argparse
import pathlib

from superfluid.core.formats.registry import FormatRegistry
from superfluid.plugins.formats import builtin_registry, roundtrip

DEFAULT_DIR = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"


def registry() -> FormatRegistry:
    return builtin_registry()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=str(DEFAULT_DIR))
    ap.add_argument("show", nargs="?")
    args = ap.parse_args(argv)
    reg = registry()
    for path in sorted(pathlib.Path(args.dir).glob("*.jinja")):
        template = path.read_text()
        detected = reg.resolve(template)
        cells = []
        for calls in (1, 2):
            whole = roundtrip.check(template, detected, calls=calls)
            streamed = roundtrip.check(template, detected, calls=calls, stream="chars") if whole.output else whole
            cells.append(f"{calls}:{'ok' if whole.ok else 'FAIL'}/{'ok' if streamed.ok else 'FAIL'}")
        tool = detected.tool_format.name if detected.tool_format else "-"
        think = detected.reasoning.name if detected.reasoning else "-"
        print(f"{path.stem[:44]:44} {tool:14} {think:10} {' '.join(cells)}")
        if args.show and args.show in path.name:
            for calls in (1, 2):
                r = roundtrip.check(template, detected, calls=calls)
                print(f"  output:   {r.output!r}\n  expected: {r.expected}\n  got:      {r.got}\n  note:     {r.note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
