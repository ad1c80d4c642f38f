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
import tempfile
import unicodedata
from typing import Callable, NamedTuple, TextIO

import numpy as np
from numpy.typing import ArrayLike

from . import reference
from ._checks import shape_str
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
# ---------------------------------------------------------------------------

TOKENS = {"zh": ("猫", "追", "红色", "激光点"), "en": ("cat", "chase", "red", "laser-dot")}
QK_AXES = {"zh": ("名词", "修饰", "动词"), "en": ("noun", "modifier", "verb")}
V_AXES = {"zh": ("动物", "运动", "颜色"), "en": ("animal", "motion", "colour")}

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


# ---------------------------------------------------------------------------
# Plain terminal tables, padded by display width
# ---------------------------------------------------------------------------


def display_width(s):
    """Columns `s` takes in a terminal: 2 for wide/fullwidth (CJK), 0 for combining marks."""
    w = 0
    for ch in s:
        if unicodedata.combining(ch):
            continue
        w += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return w


def _pad(s, width, right=True):
    fill = " " * (width - display_width(s))
    return fill + s if right else s + fill


def format_table(cells, row_labels, col_labels, corner=""):
    """Lines of a table: a header line, a rule, one line per row.

    cells : list of rows of strings. Numbers are right-aligned, labels left.
    Every returned line has the same display width.
    """
    w0 = max(display_width(x) for x in [corner, *row_labels])
    widths = [
        max(display_width(c), *(display_width(r[j]) for r in cells))
        for j, c in enumerate(col_labels)
    ]
    head = (
        _pad(corner, w0, right=False)
        + " | "
        + "  ".join(_pad(c, w) for c, w in zip(col_labels, widths))
    )
    lines = [head, "-" * display_width(head)]
    for lab, row in zip(row_labels, cells):
        lines.append(
            _pad(lab, w0, right=False) + " | " + "  ".join(_pad(c, w) for c, w in zip(row, widths))
        )
    return lines


def side_by_side(blocks, gap=5):
    """Join several tables (lists of lines) horizontally."""
    height = max(len(b) for b in blocks)
    widths = [max(display_width(x) for x in b) for b in blocks]
    out = []
    for i in range(height):
        parts = [_pad(b[i] if i < len(b) else "", w, right=False) for b, w in zip(blocks, widths)]
        out.append((" " * gap).join(parts).rstrip())
    return out


def _num(x, masked_text):
    if np.isneginf(x):
        return masked_text
    return f"{x:.3f}"


# ---------------------------------------------------------------------------
# The walk-through
# ---------------------------------------------------------------------------

TEXT = {
    "en": {
        "title": "Attention by hand: 猫 追 红色 激光点  (cat chase red laser-dot)",
        "intro": (
            "Four tokens, d = 3. Q, K and V are set by hand here (a trained model learns\n"
            "them), so that cause and effect are visible: the verb looks for nouns, the noun\n"
            "looks for its modifier. Q and K axes: noun, modifier, verb; V axes: animal,\n"
            "motion, colour."
        ),
        "causal_note": "Causal mask on: token i sees only tokens j <= i (the lower triangle).",
        "qkv": ("Q: what I look for", "K: what I can be found by", "V: what I carry"),
        "step1": "① Scores  S = Q Kᵀ / √d   (d = 3; row = the query token, column = the key token)",
        "guess1": "   Guess first: which cells should be deep? "
        "(the verb looks for nouns; the noun for its modifier)",
        "step2": "② Weights  P = softmax(S), row by row",
        "guess2": "   Guess first: is every row non-negative, and does it sum to 1?",
        "step3": "③ Output  O = P V: each row is a weighted mix of V's rows",
        "guess3": "   Guess first: whose content ends up in the new vector of 追 (chase)?",
        "masked": "-inf",
        "sum": "sum",
        "sums_ok": "   every row sums to 1 (max |sum - 1| = {err:.1e}); "
        "the smallest weight is {mn:.3f}: none is negative.",
        "sums_causal": "   the weights above the diagonal are exactly 0: the future is invisible.",
        "absorbed": "   What each token absorbed (its weights, largest first):",
        "obs_head": "What the numbers show:",
        "obs2": (
            "a. Look at the 追 (chase) row: it looks deep at both 猫 (cat, {w_cat:.0%}) "
            "and 激光点\n"
            "   (laser-dot, {w_dot:.0%}). The verb pulls its subject and its object into its new "
            "vector:\n"
            "   animal {a:.2f} (from cat), motion {m:.2f} and colour {c:.2f} (mostly from "
            "laser-dot)."
        ),
        "obs2_causal": (
            "a. Look at the 追 (chase) row: with the mask it sees only 猫 (cat, {w_cat:.0%}) and "
            "itself;\n"
            "   激光点 (laser-dot) comes later, so its weight is exactly {w_dot:.0f}. The verb "
            "cannot look\n"
            "   ahead for its object: that is what a GPT-style model lives with."
        ),
        "obs3": (
            "b. Look at the 激光点 (laser-dot) row: {w_red:.0%} of its weight goes to 红色 (red). "
            "The\n"
            "   modifier relation is captured: its colour rises from {c0:.2f} to {c1:.2f}; the "
            "dot is now red."
        ),
        "obs4": (
            "④ Recap: two matrix products and a softmax, nothing else. Who looks at whom came\n"
            "   entirely from the numbers in Q and K (set by hand here; learned in a real model).\n"
            "   The mechanism is fixed; the weights are learned."
        ),
        "code": (
            "The whole mechanism is the chapter's ten lines (attn_fast.reference.attention, in "
            "float64):\n"
            "\n"
            "    import numpy as np\n"
            "\n"
            "    def softmax(x, axis=-1):\n"
            "        x = x - x.max(axis=axis, keepdims=True)   # subtract the row max: exp "
            "cannot overflow\n"
            "        e = np.exp(x)\n"
            "        return e / e.sum(axis=axis, keepdims=True)\n"
            "\n"
            "    def attention(X, Wq, Wk, Wv, causal=False):\n"
            "        Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T    # (L,D) -> (L,d): three personas\n"
            "        S = Q @ K.T / np.sqrt(Q.shape[-1])         # (L,L): the first matrix product\n"
            "        if causal:\n"
            "            S = np.where(np.tril(np.ones_like(S)), S, -1e9)  # the lower-triangular "
            "pass\n"
            "        return softmax(S) @ V                     # the second and third steps"
        ),
        "check": "check: the fused kernel ({isa}) gives the same O as the float64 reference: "
        "max |diff| = {err:.1e}",
        "check_bad": "CHECK FAILED: the fused kernel ({isa}) differs from the reference: "
        "max |diff| = {err:.1e}",
        "try": (
            "Try it in the REPL (the chapter's exercise, L = 4, d = 3):\n"
            "    import attn_fast as af\n"
            "    from attn_fast.demo import sentence\n"
            "    X, Wq, Wk, Wv = sentence()            # or your own small random matrices\n"
            "    Q, K, V, S, P, O = af.explain(X, Wq, Wk, Wv{causal_arg})\n"
            "    af.attention(X, Wq, Wk, Wv{causal_arg})   # the fused kernel: the same O"
        ),
        "press": "   [press Enter for the next step] ",
        "no_pause": "note: stdin is not a terminal, so --step runs through without pausing",
        "plot_saved": "picture: {path}",
    },
    "zh": {
        "title": "徒手跑 attention：猫 追 红色 激光点",
        "intro": (
            "四个 token，d = 3。Q、K、V 都是手工设定的（真模型里它们由训练得来），为了让因果\n"
            "看得见，把「动词找名词」「名词找修饰语」的倾向直接写进了数字。Q、K 的三个维度：\n"
            "名词、修饰、动词；V 的三个维度：动物、运动、颜色。"
        ),
        "causal_note": "因果掩码已打开：第 i 个词只能看 j <= i 的词（下三角通行证）。",
        "qkv": ("Q：我在找什么", "K：我能被什么找到", "V：找到我后能带走什么"),
        "step1": "① 分数表  S = Q Kᵀ / √d   （d = 3；行 = 查询的词，列 = 被查的词）",
        "guess1": "   先猜再看：分数表里哪几格该深？（动词找名词，名词找修饰语）",
        "step2": "② 权重  P = softmax(S)，逐行",
        "guess2": "   先猜再看：softmax 后每行是不是非负、和为 1？",
        "step3": "③ 输出  O = P V：每一行都是 V 各行的加权混合（凸组合）",
        "guess3": "   先猜再看：「追」的新向量里混进了谁的成分？",
        "masked": "-inf",
        "sum": "行和",
        "sums_ok": "   每行和为 1（max |行和 - 1| = {err:.1e}）；"
        "最小的权重是 {mn:.3f}：没有负权重。",
        "sums_causal": "   对角线以上的权重精确为 0：未来看不见。",
        "absorbed": "   每个词吸收了谁（权重从大到小）：",
        "obs_head": "数字里看到了什么：",
        "obs2": (
            "a. 盯「追」那一行：它同时深看「猫」（{w_cat:.0%}）"
            "与「激光点」（{w_dot:.0%}）——动词把主语\n"
            "   宾语的信息抓进自己的新向量：动物 {a:.2f}（来自猫），"
            "运动 {m:.2f}、颜色 {c:.2f}（主要来自激光点）。"
        ),
        "obs2_causal": (
            "a. 盯「追」那一行：加了掩码，它只能看「猫」（{w_cat:.0%}）和自己；"
            "「激光点」在它后面，\n"
            "   权重精确为 {w_dot:.0f}。动词没法往后找宾语——GPT 式模型就是这样生成的。"
        ),
        "obs3": (
            "b. 盯「激光点」那一行：{w_red:.0%} 的权重给了「红色」——修饰关系被捕捉：\n"
            "   它的颜色分量从 {c0:.2f} 升到 {c1:.2f}，激光点变红了。"
        ),
        "obs4": (
            "④ 复盘：整个过程只有矩阵乘和一个 softmax，而「谁看谁」的智能，全部来自 Q、K 里的\n"
            "   数字（这里手工设定，真模型里是训练出来的）。机制是死的，权重是学的。"
        ),
        "code": (
            "整个机制就是本章那十行代码（attn_fast.reference.attention，float64）：\n"
            "\n"
            "    import numpy as np\n"
            "\n"
            "    def softmax(x, axis=-1):\n"
            "        x = x - x.max(axis=axis, keepdims=True)   # 减去行最大值，指数不会溢出\n"
            "        e = np.exp(x)\n"
            "        return e / e.sum(axis=axis, keepdims=True)\n"
            "\n"
            "    def attention(X, Wq, Wk, Wv, causal=False):\n"
            "        Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T    # (L,D)→(L,d) 三种人格\n"
            "        S = Q @ K.T / np.sqrt(Q.shape[-1])         # (L,L) 第一次矩阵乘\n"
            "        if causal:\n"
            "            S = np.where(np.tril(np.ones_like(S)), S, -1e9)  # 下三角通行证\n"
            "        return softmax(S) @ V                     # 第二、三步"
        ),
        "check": "核对：融合内核（{isa}）算出的 O 与 float64 参考实现一致：max |diff| = {err:.1e}",
        "check_bad": "核对失败：融合内核（{isa}）与参考实现不一致：max |diff| = {err:.1e}",
        "try": (
            "在 REPL 里亲手跑一遍（本章的练习，L = 4、d = 3）：\n"
            "    import attn_fast as af\n"
            "    from attn_fast.demo import sentence\n"
            "    X, Wq, Wk, Wv = sentence()            # 或者换成你自己的小随机矩阵\n"
            "    Q, K, V, S, P, O = af.explain(X, Wq, Wk, Wv{causal_arg})\n"
            "    af.attention(X, Wq, Wk, Wv{causal_arg})   # 融合内核：同一个 O"
        ),
        "press": "   [按回车进入下一步] ",
        "no_pause": "提示：标准输入不是终端，--step 不暂停，一次跑完",
        "plot_saved": "图：{path}",
    },
}


def _readout(P, tokens):
    """One line per token: the tokens it drew from, largest weight first (masked ones left out)."""
    lines = []
    w0 = max(display_width(t) for t in tokens)
    for i, t in enumerate(tokens):
        order = sorted((j for j in range(len(tokens)) if P[i, j] > 0), key=lambda j: -P[i, j])
        parts = [f"{tokens[j]} {P[i, j]:.0%}" for j in order]
        lines.append("   " + _pad(t, w0, right=False) + " <- " + " + ".join(parts))
    return lines


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
        cells = [[_num(x, T["masked"]) for x in row] for row in M]
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
    say(*("   " + x for x in table(ex.O, v_axes)), "", T["absorbed"], *_readout(ex.P, tokens), "")
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
# The picture
# ---------------------------------------------------------------------------

# Families known to cover the demo's characters, tried first (cheap), before
# scanning every font matplotlib knows for the glyphs.
_CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Noto Sans SC",
    "Source Han Sans SC",
    "Source Han Sans CN",
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "Microsoft YaHei",
    "SimHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "Heiti SC",
    "STHeiti",
    "Arial Unicode MS",
    "AR PL UMing CN",
    "Droid Sans Fallback",
)


def check_plot_path(path):
    """Check, before any work, that a picture can be written at `path`.

    Raises RuntimeError (with an install hint) without matplotlib, and a
    one-line ValueError naming the path when its folder does not exist or
    cannot be written, when it is a folder, or when its extension is not a
    format matplotlib writes (.png, .svg, .pdf, ...).
    """
    _require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"--plot {path}: is a folder; give a file name such as demo.png")
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    kinds = FigureCanvasBase.get_supported_filetypes()
    if ext not in kinds:
        what = f"a .{ext} file" if ext else "a file name without an extension"
        raise ValueError(
            f"--plot {path}: matplotlib cannot write {what}; use one of "
            + ", ".join("." + k for k in ("png", "svg", "pdf") if k in kinds)
            + ", ..."
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: folder {folder} does not exist")
    try:  # os.access says yes to root on a read-only file system; try it
        if os.path.exists(path):
            with open(path, "ab"):
                pass
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as e:
        raise ValueError(f"--plot {path}: cannot write there ({e.strerror or e})") from None


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'attn_fast[plot]' (or pip install matplotlib)"
        ) from None


# Fonts that map (nearly) every code point to a placeholder glyph: a box
# naming the Unicode block. matplotlib >= 3.11 ships Last Resort as its final
# fallback, so a charmap test alone would pick it and draw boxes.
_PLACEHOLDER_FAMILIES = ("last resort", "lastresort", "adobe blank", "unifont replacement")


def _no_hinting():
    from matplotlib import ft2font

    flags = getattr(ft2font, "LoadFlags", None)  # an enum from matplotlib 3.10 on
    return flags.NO_HINTING if flags is not None else ft2font.LOAD_NO_HINTING


def _is_placeholder_family(name):
    name = (name or "").lower()
    return any(p in name for p in _PLACEHOLDER_FAMILIES)


def _font_has(path, text):
    """True if the font file at `path` draws every non-ASCII character of `text` with a real glyph.

    Real means: mapped in the font's charmap, a glyph with an outline (not an
    empty one), and distinct characters get distinct glyphs with distinct
    outlines. A placeholder font such as Last Resort maps a whole Unicode
    block to one box glyph, so 猫 and 追 would share it: rejected.
    """
    from matplotlib.ft2font import FT2Font

    chars = [ch for ch in dict.fromkeys(text) if not ch.isascii() and not ch.isspace()]
    try:
        font = FT2Font(path)
        if _is_placeholder_family(font.family_name) or _is_placeholder_family(font.postscript_name):
            return False
        cmap = font.get_charmap()
        if not all(ord(ch) in cmap for ch in chars):
            return False
        if len({cmap[ord(ch)] for ch in chars}) < len(chars):
            return False  # one glyph for different characters: a placeholder
        outlines = set()
        for ch in chars:
            font.load_glyph(cmap[ord(ch)], _no_hinting())
            vertices, _codes = font.get_path()
            if len(vertices) == 0:
                return False  # an empty glyph (no contours)
            outlines.add(np.asarray(vertices).tobytes())
        return len(outlines) == len(chars)
    except Exception:  # noqa: BLE001 - an unreadable font simply does not qualify
        return False


def find_cjk_font(text=None):
    """A matplotlib font family that has glyphs for every character of `text`, or None."""
    from matplotlib import font_manager

    text = (
        text
        if text is not None
        else "".join(TOKENS["zh"]) + "".join(QK_AXES["zh"]) + "分数权重行和查询被"
    )
    fonts = font_manager.fontManager.ttflist
    known = {f: i for i, f in enumerate(_CJK_FAMILIES)}
    candidates = sorted((f for f in fonts if f.name in known), key=lambda f: known[f.name])
    candidates += [f for f in fonts if f.name not in known]
    for f in candidates:
        if _is_placeholder_family(f.name):
            continue
        if _font_has(f.fname, text):
            return f.name
    return None


PLOT_TEXT = {
    "en": {
        "S": "① scores  S = Q Kᵀ / √d",
        "P": "② weights  P = softmax(S)",
        "q": "query (row)",
        "k": "key (column)",
        "title": "猫 追 红色 激光点: attention by hand",
        "title_ascii": "cat chase red laser-dot: attention by hand",
        "causal": " (causal)",
    },
    "zh": {
        "S": "① 分数  S = Q Kᵀ / √d",
        "P": "② 权重  P = softmax(S)",
        "q": "查询（行）",
        "k": "被查（列）",
        "title": "猫 追 红色 激光点：徒手跑 attention",
        "causal": "（因果掩码）",
    },
}


def plot_tables(ex, path, lang="en", causal=False):
    """Draw S and P as annotated heatmaps, tokens on both axes; save to `path`.

    Chinese labels need a CJK font; if none is found, the labels fall back to
    English and the returned note says so (otherwise returns None).
    Raises RuntimeError with an install hint when matplotlib is missing, and
    ValueError when matplotlib cannot write `path` (check_plot_path).
    """
    check_plot_path(path)
    import matplotlib
    from matplotlib.figure import Figure

    font = find_cjk_font()
    note = None
    if font is None:
        if lang == "zh":
            note = (
                "note: no CJK font found for matplotlib (e.g. apt install fonts-noto-cjk); "
                "the picture uses English labels."
            )
        lang = "en"
        tokens = TOKENS["en"]
        title = PLOT_TEXT["en"]["title_ascii"]
    else:
        tokens = (
            TOKENS[lang]
            if lang == "zh"
            else tuple(f"{z}\n{e}" for z, e in zip(TOKENS["zh"], TOKENS["en"]))
        )
        title = PLOT_TEXT[lang]["title"]
    PT = PLOT_TEXT[lang]
    # DejaVu first for digits and symbols; matplotlib falls back per glyph to the CJK font.
    family = ["DejaVu Sans", font] if font else ["DejaVu Sans"]

    L = len(tokens)
    fig = Figure(figsize=(10.4, 4.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    masked = ~np.isfinite(ex.S)
    panels = (
        (axes[0], np.where(masked, np.nan, ex.S), PT["S"], "Blues", "−∞", None),
        (
            axes[1],
            np.where(masked, np.nan, ex.P),
            PT["P"],
            "Oranges",
            "0",
            0.0,
        ),  # weights: colour from 0
    )
    for ax, M, label, cmap, masked_text, vmin in panels:
        finite = M[np.isfinite(M)]
        lo, hi = (float(finite.min()) if vmin is None else vmin), float(finite.max())
        cm = matplotlib.colormaps[cmap].with_extremes(bad="#eeeeee")  # masked cells: light grey
        im = ax.imshow(np.ma.masked_invalid(M), cmap=cm, vmin=lo, vmax=hi)
        for i in range(L):
            for j in range(L):
                if masked[i, j]:
                    txt, color = masked_text, "#888888"
                else:
                    x = M[i, j]
                    txt = f"{x:.2f}"
                    color = "white" if (x - lo) > 0.6 * (hi - lo) else "black"
                ax.text(
                    j, i, txt, ha="center", va="center", color=color, fontsize=11, family=family
                )
        ax.set_xticks(range(L), tokens, family=family, fontsize=11)
        ax.set_yticks(range(L), tokens, family=family, fontsize=11)
        ax.xaxis.tick_top()
        ax.xaxis.set_label_position("top")
        ax.set_xlabel(PT["k"], family=family)
        ax.set_ylabel(PT["q"], family=family)
        ax.set_title(label, family=family, fontsize=12)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title + (PT["causal"] if causal else ""), family=family, fontsize=13)
    fig.savefig(path)
    return note


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
