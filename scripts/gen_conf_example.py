#!/usr/bin/env python3
"""Regenerates config/rolloutd.conf.example from `rolloutd --help` (the settings table).

    python3 scripts/gen_conf_example.py [build/rolloutd]

tests/unit/test_config.c checks that the example documents every key and loads cleanly.
"""
import pathlib
import re
import subprocess
import sys

root = pathlib.Path(__file__).resolve().parents[1]
binary = sys.argv[1] if len(sys.argv) > 1 else str(root / "build" / "rolloutd")
lines = subprocess.run([binary, "--help"], capture_output=True, text=True, check=True).stdout.splitlines()
out = ["# rolloutd.conf.example — every setting, with its default. Use with: rolloutd --config FILE",
       "# Lines are `name = value`; # starts a comment (at a line's start, or after a space); quote a value",
       "# (\"...\") to keep a \" #\" in it; flags given on the command line override the file.",
       ""]
for i, line in enumerate(lines):
    m = re.match(r"  --([a-z0-9-]+) (\S+)\s+(.*)", line)
    if not m or m.group(1) in ("config", "help"):
        continue
    name, _, doc = m.groups()
    d = re.match(r"\(default: (.*?)(;.*)?\)$", lines[i + 1].strip())
    default = d.group(1) if d else ""
    extra = (d.group(2) or "").lstrip("; ") if d else ""
    if default == '""':
        default = ""
    out.append("# " + doc + (f" ({extra})" if extra else ""))
    out.append(f"# {name} =" if default == "" else f"{name} = {default}")
    out.append("")
(root / "config" / "rolloutd.conf.example").write_text("\n".join(out).rstrip() + "\n")
