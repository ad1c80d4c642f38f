"""The chapter's demo, runnable: attention by hand on "猫 追 红色 激光点".

    python -m attn_fast demo [--step] [--causal] [--lang en|zh] [--plot out.png]

Four tokens (cat, chase, red, laser-dot) with hand-set 3-dimensional Q, K
and V whose numbers encode "the verb looks for nouns" and "the noun looks for
its modifier". The demo walks the chapter's three steps and its four guided
observations::

    ① S = Q Kᵀ / √d       the score table (guess first: which cells are deep?)
    ② P = softmax(S)      row by row; each row is non-negative and sums to 1
    ③ O = P V             each output row is a convex mix of V's rows; the
                          readout names what each token absorbed
    ④ recap               the mechanism is fixed, the weights are learned

`explain(X, Wq, Wk, Wv, causal=False)` returns the same intermediates for any
small input, for the chapter's REPL exercise (L = 4, d = 3). It is computed by
the float64 reference path; the demo checks that the fused kernel gives the
same O.

Terminal tables contain only ASCII and wide CJK characters and are padded by
display width (a CJK character takes two columns), so they line up in a CJK
terminal too. Only NumPy is needed; ``--plot`` needs matplotlib (the ``plot``
extra) and, for Chinese labels, a CJK font found at run time.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NamedTuple, TextIO

import numpy as np
from numpy.typing import ArrayLike

from . import reference
from ._checks import shape_str
from ._demo_plot import check_plot_path, plot_tables
from ._demo_text import (  # noqa: F401  (display_width: attn_fast.demo.display_width)
    QK_AXES,
    TEXT,
    TOKENS,
    V_AXES,
    display_width,
    format_table,
    num,
    readout,
    side_by_side,
)
from .functional import check_textbook_args

__all__ = ["Explained", "explain", "main", "run", "sentence"]

# ---------------------------------------------------------------------------
# The sentence and its hand-set vectors.
#
# Q and K share three feature axes: (noun, modifier, verb). K says what a token
# *is* (what it can be found by); Q says what it *looks for*:
#   猫 cat        is a noun,     looks for a verb (what is it doing?)
#   追 chase      is a verb,     looks for nouns (who chases, what is chased)
#   红色 red      is a modifier, looks for nouns (what is red?)
#   激光点 laser  is a noun,     looks for its modifier
# V carries content on three other axes: (animal, motion, colour).
# The names of the tokens and axes, in both languages: _demo_text.TOKENS, QK_AXES, V_AXES.
# ---------------------------------------------------------------------------

Q_DEMO = np.array(
    [
        [0.5, 0.0, 2.0],  # 猫: what am I doing? (a verb)
        [3.0, 0.0, 0.0],  # 追: who and what? (nouns)
        [1.5, 0.0, 0.0],  # 红色: what is red? (nouns)
        [0.5, 3.0, 0.0],  # 激光点: what kind of dot? (its modifier)
    ]
)
K_DEMO = np.array(
    [
        [1.0, 0.0, 0.0],  # 猫 is a noun
        [0.0, 0.0, 1.0],  # 追 is a verb
        [0.0, 1.0, 0.0],  # 红色 is a modifier
        [1.0, 0.0, 0.0],  # 激光点 is a noun
    ]
)
V_DEMO = np.array(
    [
        [1.0, 0.0, 0.0],  # 猫: an animal
        [0.0, 1.0, 0.0],  # 追: motion
        [0.0, 0.0, 1.0],  # 红色: colour
        [0.0, 0.5, 0.5],  # 激光点: a moving spot of light
    ]
)


def sentence() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The demo's inputs in the textbook's form: (X, Wq, Wk, Wv), float64.

    X is the (4, 4) one-hot embedding lookup of the four tokens, so
    Q = X Wqᵀ is exactly the hand-set Q (likewise K, V): Wq = Q_DEMO.T etc.,
    each (3, 4).
    """
    X = np.eye(4)
    return X, Q_DEMO.T.copy(), K_DEMO.T.copy(), V_DEMO.T.copy()


# ---------------------------------------------------------------------------
# explain(): the intermediates, by the reference path
# ---------------------------------------------------------------------------


class Explained(NamedTuple):
    """Intermediates of one attention call, float64.

    Q, K : (…, L, d); V : (…, L, dv); S : (…, L, L) scores Q Kᵀ / √d (-inf
    where the causal mask hides a key); P : (…, L, L) softmax weights (exactly
    0 where masked); O : (…, L, dv) = P V.
    """

    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    S: np.ndarray
    P: np.ndarray
    O: np.ndarray


def explain(
    X: ArrayLike, Wq: ArrayLike, Wk: ArrayLike, Wv: ArrayLike, causal: bool = False
) -> Explained:
    """Run the textbook's attention step by step and return every intermediate.

    X : (L, D) or (B, L, D); Wq, Wk : (d, D); Wv : (dv, D); float32/float64.
    Computes, in float64 with the reference softmax (`attn_fast.reference`)::

        Q, K, V = X Wqᵀ, X Wkᵀ, X Wvᵀ
        S = Q Kᵀ / √d                 (masked entries -inf when causal)
        P = softmax(S) row by row     (masked entries exactly 0)
        O = P V

    Returns an `Explained` named tuple (Q, K, V, S, P, O); unpack it or read
    the fields. Every array is a new float64 array. Meant for small inputs:
    S and P are materialised.
    """
    X, Wq, Wk, Wv = check_textbook_args(X, Wq, Wk, Wv)
    if Wq.shape[0] == 0:
        raise ValueError(f"Wq has shape {shape_str(Wq)}: d must be at least 1")
    if X.shape[-2] == 0:
        raise ValueError(f"X has shape {shape_str(X)}: need at least one token")
    X, Wq, Wk, Wv = (a.astype(np.float64) for a in (X, Wq, Wk, Wv))
    Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T  # three personas
    S = Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])  # first matrix product
    if causal:
        L = S.shape[-1]
        S = np.where(np.tril(np.ones((L, L), dtype=bool)), S, -np.inf)
    P = reference.softmax(S, axis=-1)  # exp(-inf) is exactly 0
    O = P @ V  # third matrix product
    return Explained(Q, K, V, S, P, O)


def _kernel_check(ex, causal):
    """O from the fused kernel (float64) on the demo's X, Wq, Wk, Wv, vs the reference."""
    from ._config import get_isa
    from .functional import attention

    O_fast = attention(*sentence(), causal=causal)
    return get_isa(), float(np.max(np.abs(O_fast - ex.O)))


def run(
    lang: str = "en",
    causal: bool = False,
    step: bool = False,
    plot: str | None = None,
    file: TextIO | None = None,
    input_fn: Callable[[str], str] = input,
) -> int:
    """Print the walk-through; return a process exit code (0 = all checks passed).

    lang : "en" or "zh" (labels and commentary). causal : apply the causal
    mask. step : pause for Enter between the steps; if reading stdin fails
    (closed: EOFError, or no sys.stdin at all) the rest runs through, with a
    one-line note on stderr. plot : a path; also draw the score and weight
    tables as heatmaps there (needs matplotlib; the path is checked before
    the walk-through, see check_plot_path: ValueError, RuntimeError).
    """
    if lang not in TEXT:
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    out = sys.stdout if file is None else file
    T = TEXT[lang]
    if plot is not None:
        check_plot_path(plot)  # fail before the walk-through, not after it
    tokens, qk_axes, v_axes = TOKENS[lang], QK_AXES[lang], V_AXES[lang]
    ex = explain(*sentence(), causal=causal)

    def say(*lines):
        for line in lines:
            print(line, file=out)

    pausing = [bool(step)]

    def pause():
        if not pausing[0]:
            return
        try:
            input_fn(T["press"])
        except (EOFError, RuntimeError, OSError):  # stdin closed or gone (input(): lost sys.stdin)
            pausing[0] = False
            print(T["no_pause"], file=sys.stderr)
        say("")

    def table(M, cols, corner=""):
        cells = [[num(x, T["masked"]) for x in row] for row in M]
        return format_table(cells, tokens, cols, corner)

    say(T["title"], "", T["intro"])
    if causal:
        say(T["causal_note"])
    say("")
    qkv = [table(M, axes) for M, axes in ((ex.Q, qk_axes), (ex.K, qk_axes), (ex.V, v_axes))]
    say(*side_by_side([[title, *t] for title, t in zip(T["qkv"], qkv)]), "")
    pause()

    # ① scores
    say(T["step1"], T["guess1"])
    pause()
    say(*("   " + x for x in table(ex.S, tokens, corner="Q \\ K")), "")
    pause()

    # ② weights, with row sums
    say(T["step2"], T["guess2"])
    pause()
    sums = ex.P.sum(axis=-1)
    cells = [
        [("0" if p == 0 else f"{p:.3f}") for p in row] + [f"{s:.3f}"] for row, s in zip(ex.P, sums)
    ]
    say(*("   " + x for x in format_table(cells, tokens, [*tokens, T["sum"]], "Q \\ K")))
    say(T["sums_ok"].format(err=float(np.max(np.abs(sums - 1))), mn=float(ex.P.min())))
    if causal:
        say(T["sums_causal"])
    say("")
    pause()

    # ③ outputs and what each token absorbed
    say(T["step3"], T["guess3"])
    pause()
    say(*("   " + x for x in table(ex.O, v_axes)), "", T["absorbed"], *readout(ex.P, tokens), "")
    pause()

    # the guided observations a. and b., with the numbers just computed, then ④ the recap
    cat, chase, red, dot = range(4)
    say(T["obs_head"])
    if causal:
        say(T["obs2_causal"].format(w_cat=ex.P[chase, cat], w_dot=ex.P[chase, dot]), "")
    else:
        a, m, c = ex.O[chase]
        say(T["obs2"].format(w_cat=ex.P[chase, cat], w_dot=ex.P[chase, dot], a=a, m=m, c=c), "")
    say(T["obs3"].format(w_red=ex.P[dot, red], c0=ex.V[dot, 2], c1=ex.O[dot, 2]), "")
    say(T["obs4"], "", T["code"], "")

    isa, err = _kernel_check(ex, causal)
    ok = err <= 1e-12
    say(T["check" if ok else "check_bad"].format(isa=isa, err=err), "")
    say(T["try"].format(causal_arg=", causal=True" if causal else ""))
    if plot is not None:
        note = plot_tables(ex, path=plot, lang=lang, causal=causal)
        if note:
            print(note, file=sys.stderr)
        say("", T["plot_saved"].format(path=plot))
    return 0 if ok else 1


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _default_lang():
    for var in ("LC_ALL", "LC_MESSAGES", "LANG"):
        val = os.environ.get(var, "")
        if val:
            return "zh" if val.lower().startswith("zh") else "en"
    return "en"


def _stdin_is_terminal():
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):  # closed
        return False


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`demo [--step] [--causal] [--lang en|zh] [--plot PATH]`; returns the process exit code."""
    p = argparse.ArgumentParser(
        prog=prog or "python -m attn_fast demo",
        description="The chapter's demo: attention by hand on 猫 追 红色 激光点 "
        "(cat chase red laser-dot).",
    )
    p.add_argument("--step", action="store_true", help="pause between the steps (press Enter)")
    p.add_argument("--causal", action="store_true", help="apply the causal mask (lower triangle)")
    p.add_argument(
        "--lang",
        choices=("en", "zh"),
        default=None,
        help="labels and commentary (default: from $LANG)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="also draw S and P as heatmaps into FILE (.png, .svg, .pdf, ...; needs matplotlib)",
    )
    args = p.parse_args(argv)
    stream = sys.stdout
    enc = getattr(stream, "encoding", None) or "ascii"
    try:
        "猫ᵀ√①".encode(enc)
    except (UnicodeEncodeError, LookupError):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")  # a terminal that cannot show CJK: keep going
    lang = args.lang or _default_lang()
    step = args.step
    if step and not _stdin_is_terminal():  # a pipe, CI, closed stdin: nobody to press Enter
        print(TEXT[lang]["no_pause"], file=sys.stderr)
        step = False
    try:
        if args.plot is not None:
            check_plot_path(args.plot)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run(lang=lang, causal=args.causal, step=step, plot=args.plot)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `python -m attn_fast demo | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
