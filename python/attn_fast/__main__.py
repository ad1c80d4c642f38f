"""Command line: python -m attn_fast {bench,config,demo}."""

from __future__ import annotations

import sys

USAGE = """usage: python -m attn_fast COMMAND [options]

commands:
  bench    prefill benchmark: attn_fast vs textbook NumPy vs torch (if installed);
           bench --quick | --full: the suite (peers, FMA peak, bandwidth, JSON + PNG)
  config   print version, ISA, OpenMP runtime and thread count
  demo     the chapter's demo: attention by hand on 猫 追 红色 激光点 (--step, --causal, --lang, --plot)
"""


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if cmd == "config":
        from ._config import show_config

        show_config()
        return 0
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
