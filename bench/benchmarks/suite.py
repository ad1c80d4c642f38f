#!/usr/bin/env python3
"""The benchmark suite; same as `python -m attn_fast bench --full` (see bench/README.md)."""

import sys

from attn_fast._bench.suite import main

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args if ("--quick" in args or "--full" in args) else ["--full", *args]))
