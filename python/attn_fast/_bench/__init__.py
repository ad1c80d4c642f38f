"""The benchmark harness behind ``python -m attn_fast bench``: private, not API.

It lives in the package (and not only in bench/) because the installed command runs it.
Modules, by topic:

    common    what both commands use: the textbook NumPy peer, peer imports, simple timers
    prefill   ``bench`` without --quick/--full: the prefill table against NumPy and torch
    cases     the suite's cases, their inputs and the oracle check
    peers     each implementation's callable for a case (attn_fast, NumPy, torch, onnxruntime)
    measure   the machine's limits, interleaved timing, peak memory of one call
    tables    the printed rows, the targets judged on a run, the plot
    suite     ``bench --quick`` / ``--full``: the run and its command line
"""
