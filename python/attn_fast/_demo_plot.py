"""The demo's picture: S and P as annotated heatmaps (``--plot``), with the checks
that run before any work (matplotlib present, the path writable) and the search
for a font that really draws the Chinese labels (a placeholder font such as Last
Resort maps every character to a box, so it does not count).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from ._demo_text import QK_AXES, TOKENS

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
