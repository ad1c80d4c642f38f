"""The demo's words, in English and Chinese, and the terminal tables that show its numbers.

TOKENS, QK_AXES and V_AXES name the four tokens and the feature axes of Q/K and
of V; TEXT holds the walk-through's commentary (``attn_fast.demo.run`` prints it,
step by step). Tables are padded by display width (a CJK character takes two
columns), so they line up in a CJK terminal too.
"""

from __future__ import annotations

import unicodedata

import numpy as np

TOKENS = {"zh": ("猫", "追", "红色", "激光点"), "en": ("cat", "chase", "red", "laser-dot")}
QK_AXES = {"zh": ("名词", "修饰", "动词"), "en": ("noun", "modifier", "verb")}
V_AXES = {"zh": ("动物", "运动", "颜色"), "en": ("animal", "motion", "colour")}


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


def num(x, masked_text):
    if np.isneginf(x):
        return masked_text
    return f"{x:.3f}"


def readout(P, tokens):
    """One line per token: the tokens it drew from, largest weight first (masked ones left out)."""
    lines = []
    w0 = max(display_width(t) for t in tokens)
    for i, t in enumerate(tokens):
        order = sorted((j for j in range(len(tokens)) if P[i, j] > 0), key=lambda j: -P[i, j])
        parts = [f"{tokens[j]} {P[i, j]:.0%}" for j in order]
        lines.append("   " + _pad(t, w0, right=False) + " <- " + " + ".join(parts))
    return lines


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
