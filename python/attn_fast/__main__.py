"""Command line: python -m attn_fast {bench,config,demo} (or the `attn-fast` console script)."""

from __future__ import annotations

import os
import sys

USAGE = """usage: {prog} COMMAND [options]

commands:
  bench    prefill benchmark: attn_fast vs textbook NumPy vs torch (if installed);
           bench --quick | --full: the suite (peers, FMA peak, bandwidth, JSON + PNG)
  config   print version, ISA, OpenMP runtime and thread count
  demo     the chapter's demo: attention by hand on 猫 追 红色 激光点
           (--step, --causal, --lang, --plot)

{prog} COMMAND --help shows a command's options.
"""


def prog_name(argv0=None):
    """The program name as invoked: "python -m attn_fast", or the console
    script's name ("attn-fast")."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    base = os.path.basename(argv0 or "")
    if not base or base in ("-c", "-m") or base.startswith("__main__") or base.endswith(".py"):
        return "python -m attn_fast"
    return base


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog_name()
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(prog=prog))
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from ._bench.prefill import main as bench_main

        return bench_main(rest, prog=f"{prog} bench")
    if cmd == "config":
        from ._config import show_config

        show_config()
        return 0
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest, prog=f"{prog} demo")
    print(f"unknown command {cmd!r}\n\n{USAGE.format(prog=prog)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
