"""The chapter's demo (python -m attn_fast demo) and explain(): numbers, tables, picture."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import unicodedata

import numpy as np
import pytest
from helpers import assert_close

import attn_fast as af
from attn_fast import _demo_plot, demo
from attn_fast import reference as ref
from attn_fast.__main__ import main as cli_main

# ---------------------------------------------------------------------------
# explain()
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L,D,d,dv", [(1, 1, 1, 1), (4, 3, 3, 3), (7, 5, 5, 2), (129, 16, 80, 7)])
def test_explain_matches_oracle_and_kernel(rng, dtype, causal, L, D, d, dv):
    X = rng.standard_normal((L, D)).astype(dtype)
    Wq, Wk = (rng.standard_normal((d, D)).astype(dtype) for _ in range(2))
    Wv = rng.standard_normal((dv, D)).astype(dtype)
    Q, K, V, S, P, O = af.explain(X, Wq, Wk, Wv, causal=causal)
    for a in (Q, K, V, S, P, O):
        assert a.dtype == np.float64
    assert Q.shape == K.shape == (L, d) and V.shape == (L, dv)
    assert S.shape == P.shape == (L, L) and O.shape == (L, dv)
    X64, Wq64, Wk64, Wv64 = (a.astype(np.float64) for a in (X, Wq, Wk, Wv))
    for got, W in ((Q, Wq64), (K, Wk64), (V, Wv64)):
        np.testing.assert_allclose(got, X64 @ W.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        S[np.isfinite(S)], (Q @ K.T / np.sqrt(d))[np.isfinite(S)], rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(O, P @ V, rtol=1e-12, atol=1e-12)
    # the chapter's ten lines (reference.attention) and the fused kernel agree
    assert_close(O, ref.attention(X, Wq, Wk, Wv, causal=causal), np.float64)
    assert_close(af.attention(X, Wq, Wk, Wv, causal=causal), O, dtype)
    np.testing.assert_allclose(P.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    assert (P >= 0).all()
    if causal:
        upper = np.triu(np.ones((L, L), dtype=bool), 1)
        assert np.isneginf(S[upper]).all() and (P[upper] == 0).all()
        assert np.isfinite(S[~upper]).all()
    else:
        assert np.isfinite(S).all()


def test_explain_batched_and_noncontiguous(rng):
    X = rng.standard_normal((3, 9, 6))[:, ::-1, :]  # (B, L, D), negative stride
    Wq, Wk, Wv = (rng.standard_normal((6, 4)).T for _ in range(3))  # (4, 6), transposed views
    ex = af.explain(X, Wq, Wk, Wv, causal=True)
    assert ex.S.shape == (3, 9, 9) and ex.O.shape == (3, 9, 4)
    for b in range(3):
        one = af.explain(X[b], Wq, Wk, Wv, causal=True)
        np.testing.assert_allclose(ex.O[b], one.O, rtol=1e-13, atol=1e-13)
    assert_close(ex.O, af.attention(X, Wq, Wk, Wv, causal=True), np.float64)


def test_explain_errors():
    X, Wq, Wk, Wv = demo.sentence()
    with pytest.raises(ValueError, match=r"Wk must be \(d, D\) with D = 4"):
        af.explain(X, Wq, Wk[:, :3], Wv)
    with pytest.raises(ValueError, match=r"Wq has shape \(3, 4\) but Wk has shape \(2, 4\)"):
        af.explain(X, Wq, Wk[:2], Wv)
    with pytest.raises(ValueError, match=r"X must be \(L, D\) or \(B, L, D\), got shape \(4,\)"):
        af.explain(X[0], Wq, Wk, Wv)
    with pytest.raises(TypeError, match="X must be float32 or float64"):
        af.explain(X.astype(np.int64), Wq, Wk, Wv)
    with pytest.raises(TypeError, match="mixed dtypes"):
        af.explain(X.astype(np.float32), Wq, Wk, Wv)
    with pytest.raises(ValueError, match="at least one token"):
        af.explain(X[:0], Wq, Wk, Wv)


# ---------------------------------------------------------------------------
# The sentence's hand-set numbers do what the chapter says
# ---------------------------------------------------------------------------


def test_sentence_is_the_hand_set_qkv():
    ex = af.explain(*demo.sentence())
    np.testing.assert_array_equal(ex.Q, demo.Q_DEMO)
    np.testing.assert_array_equal(ex.K, demo.K_DEMO)
    np.testing.assert_array_equal(ex.V, demo.V_DEMO)


def test_sentence_encodes_the_chapters_observations():
    cat, chase, red, dot = range(4)
    P = af.explain(*demo.sentence()).P
    # ② the verb looks at both its subject and its object, more than at anything else
    top2 = set(np.argsort(P[chase])[-2:])
    assert top2 == {cat, dot}
    assert P[chase, cat] > 2 * max(P[chase, chase], P[chase, red])
    # ③ the noun gives its modifier the largest weight
    assert np.argmax(P[dot]) == red and P[dot, red] > 0.5
    # causal: 追 can no longer see 激光点, which comes after it
    Pc = af.explain(*demo.sentence(), causal=True).P
    assert Pc[chase, dot] == 0 and np.argmax(Pc[chase]) == cat


# ---------------------------------------------------------------------------
# Terminal tables
# ---------------------------------------------------------------------------


def test_display_width():
    assert demo.display_width("abc") == 3
    assert demo.display_width("猫") == 2
    assert demo.display_width("激光点") == 6
    assert demo.display_width("e\u0301") == 1  # e + combining acute
    assert demo.display_width("Ｑ:") == 3  # fullwidth Q


def test_format_table_aligns_cjk():
    lines = demo.format_table(
        [["1.000", "0"], ["0.5", "12.25"]], ["猫", "激光点"], ["红色", "laser-dot"], "Q \\ K"
    )
    widths = {demo.display_width(x) for x in lines}
    assert len(widths) == 1
    # the column separator sits at the same display column on every line
    cols = {demo.display_width(x[: x.index("|")]) for x in lines if "|" in x}
    assert len(cols) == 1


def _tables(text):
    """Groups of consecutive lines that belong to a table (they contain ' | ')."""
    groups, cur = [], []
    for line in text.splitlines():
        if " | " in line or (cur and set(line.strip()) == {"-"}):
            cur.append(line)
        elif cur:
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    return groups


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("causal", [False, True])
def test_run_prints_the_walkthrough(lang, causal):
    buf = io.StringIO()
    assert demo.run(lang=lang, causal=causal, file=buf) == 0
    text = buf.getvalue()
    for tok in demo.TOKENS[lang]:
        assert tok in text
    for mark in "①②③④":
        assert mark in text
    assert "Q K" in text and "softmax" in text
    # the weights table: one row per token, the weights as computed, each row summing to 1.000
    ex = af.explain(*demo.sentence(), causal=causal)
    tables = _tables(text)
    (weights,) = [t for t in tables if demo.TEXT[lang]["sum"] in t[0]]
    assert len(weights) == 2 + 4
    for row, p in zip(weights[2:], ex.P):
        shown = [float(x) for x in row.split("|")[1].split()]
        np.testing.assert_allclose(shown[:-1], p, atol=5e-4)
        assert shown[-1] == 1.0
    # masked cells show -inf in the score table and 0 in the weight table
    assert ("-inf" in text) == causal
    # the kernel check passed and says so
    assert ("max |diff|" in text) and ("FAILED" not in text) and ("失败" not in text)
    # every table lines up by display width, and holds no ambiguous-width characters
    assert len(tables) >= 4
    for t in tables:
        seps = {demo.display_width(x[: x.index("|")]) for x in t if "|" in x}
        assert len(seps) == 1, t
        for line in t:
            assert not any(unicodedata.east_asian_width(ch) == "A" for ch in line), line


def test_readout_names_what_chase_absorbed():
    buf = io.StringIO()
    demo.run(lang="zh", file=buf)
    line = next(x for x in buf.getvalue().splitlines() if x.strip().startswith("追") and "<-" in x)
    sources = [part.split()[0] for part in line.split("<-")[1].split("+")]
    assert set(sources[:2]) == {"猫", "激光点"}


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_ten_lines_shown_are_the_code_that_runs(lang):
    """The demo prints the chapter's ten lines; executed, they give explain()'s numbers."""
    buf = io.StringIO()
    demo.run(lang=lang, file=buf)
    block = demo.TEXT[lang]["code"]
    assert block in buf.getvalue()
    source = textwrap.dedent(block.split("\n", 1)[1])
    namespace = {}
    exec(compile(source, "<demo ten lines>", "exec"), namespace)  # noqa: S102 - our own text
    for causal in (False, True):
        O = namespace["attention"](*demo.sentence(), causal=causal)
        np.testing.assert_allclose(
            O, af.explain(*demo.sentence(), causal=causal).O, rtol=1e-14, atol=1e-15
        )


def test_step_pauses_between_steps():
    prompts = []
    buf = io.StringIO()
    demo.run(lang="en", step=True, file=buf, input_fn=prompts.append)
    assert len(prompts) >= 6
    none = []
    assert demo.run(lang="en", step=False, file=io.StringIO(), input_fn=none.append) == 0
    assert none == []

    def eof(_prompt):
        raise EOFError

    assert (
        demo.run(lang="zh", step=True, file=io.StringIO(), input_fn=eof) == 0
    )  # stdin closed: keep going


def test_cli_demo(capsys):
    assert cli_main(["demo", "--lang", "zh", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "激光点" in out and "因果" in out
    assert cli_main(["demo", "--lang", "en"]) == 0
    assert "laser-dot" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["demo", "--lang", "fr"])
    capsys.readouterr()
    assert cli_main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# The picture
# ---------------------------------------------------------------------------


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    assert cli_main(["demo", "--lang", "zh", "--causal", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out


def test_plot_falls_back_to_english_without_cjk_font(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(_demo_plot, "find_cjk_font", lambda text=None: None)
    buf = io.StringIO()
    path = tmp_path / "en.png"
    # pytest turns warnings into errors: a CJK label drawn without a font would fail here
    assert demo.run(lang="zh", plot=str(path), file=buf) == 0
    err = capsys.readouterr().err
    assert (
        "no CJK font" in err and len(err.strip().splitlines()) == 1
    )  # the note: one line, on stderr
    assert "no CJK font" not in buf.getvalue()
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_found_cjk_font_has_the_glyphs():
    pytest.importorskip("matplotlib")
    from matplotlib import font_manager

    name = _demo_plot.find_cjk_font()
    if name is None:
        pytest.skip("no CJK font on this machine")
    path = font_manager.findfont(
        font_manager.FontProperties(family=name), fallback_to_default=False
    )
    assert _demo_plot._font_has(path, "猫追红色激光点")


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert cli_main(["demo", "--plot", str(tmp_path / "x.png")]) == 2
    cap = capsys.readouterr()
    assert "pip install 'attn_fast[plot]'" in cap.err
    assert "①" not in cap.out  # it fails before the walk-through, not after


# ---------------------------------------------------------------------------
# A fresh machine: placeholder fonts, no CJK font, no terminal, bad --plot paths
# ---------------------------------------------------------------------------

_CJK = re.compile(r"[\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef]")


def _placeholder_fonts():
    from matplotlib import font_manager

    return [f for f in font_manager.fontManager.ttflist if "last resort" in f.name.lower()]


def test_placeholder_font_is_not_a_cjk_font(monkeypatch):
    """matplotlib >= 3.11 ships Last Resort, which maps every code point to a box glyph."""
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib import font_manager

    dejavu = font_manager.findfont(
        font_manager.FontProperties(family="DejaVu Sans"), fallback_to_default=False
    )
    assert _demo_plot._font_has(
        dejavu, "éü√ᵀ①"
    )  # a real font with real glyphs passes (the check can say yes)
    assert not _demo_plot._font_has(dejavu, "猫")  # and one without the glyph does not
    lr = _placeholder_fonts()
    if not lr:
        assert tuple(int(x) for x in matplotlib.__version__.split(".")[:2]) < (3, 11)
        pytest.skip("this matplotlib ships no Last Resort font")
    for f in lr:
        assert not _demo_plot._font_has(f.fname, "猫追红色激光点")
    # rejected by its glyphs (one box for a whole block), not only by its name
    monkeypatch.setattr(_demo_plot, "_is_placeholder_family", lambda name: False)
    for f in lr:
        assert not _demo_plot._font_has(f.fname, "猫追红色激光点")
    # a font list of DejaVu and Last Resort only has no CJK font
    monkeypatch.setattr(
        font_manager.fontManager,
        "ttflist",
        [f for f in font_manager.fontManager.ttflist if f.fname == dejavu] + lr,
    )
    assert _demo_plot.find_cjk_font() is None


def test_found_cjk_font_is_real():
    pytest.importorskip("matplotlib")
    from matplotlib import font_manager

    name = _demo_plot.find_cjk_font()
    if name is None:
        # nothing found: then matplotlib knows none of the usual CJK families either
        known = {f.name for f in font_manager.fontManager.ttflist} & set(_demo_plot._CJK_FAMILIES)
        assert not known, known
        pytest.skip("no CJK font on this machine")
    assert "last resort" not in name.lower()


def _figure_texts(monkeypatch):
    """Record every text drawn into figures saved while the returned list is alive."""
    from matplotlib.figure import Figure

    texts = []
    real = Figure.savefig

    def savefig(self, *args, **kwargs):
        texts.extend(t.get_text() for t in self.findobj(lambda a: hasattr(a, "get_text")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return texts


def test_plot_zh_without_cjk_font_uses_english_labels(tmp_path, monkeypatch, capsys):
    """Only matplotlib's own fonts (DejaVu, Last Resort, ...):
    English labels, the note on stderr."""
    pytest.importorskip("matplotlib")
    import matplotlib
    from matplotlib import font_manager

    own = os.path.dirname(matplotlib.get_data_path())
    monkeypatch.setattr(
        font_manager.fontManager,
        "ttflist",
        [f for f in font_manager.fontManager.ttflist if f.fname.startswith(own)],
    )
    texts = _figure_texts(monkeypatch)
    path = tmp_path / "zh.png"
    assert cli_main(["demo", "--lang", "zh", "--plot", str(path)]) == 0
    cap = capsys.readouterr()
    assert path.read_bytes()[:4] == b"\x89PNG"
    (note,) = cap.err.strip().splitlines()
    assert "no CJK font" in note and "English labels" in note
    assert "cat" in texts and "laser-dot" in texts
    assert not any(_CJK.search(t) for t in texts), [t for t in texts if _CJK.search(t)]
    dejavu = font_manager.findfont(
        font_manager.FontProperties(family="DejaVu Sans"), fallback_to_default=False
    )
    assert _demo_plot._font_has(dejavu, "".join(texts))  # every glyph drawn is a real DejaVu glyph


def test_plot_zh_with_cjk_font_uses_chinese_labels(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    if _demo_plot.find_cjk_font() is None:
        pytest.skip("no CJK font on this machine (apt install fonts-noto-cjk to run this)")
    texts = _figure_texts(monkeypatch)
    assert cli_main(["demo", "--lang", "zh", "--plot", str(tmp_path / "zh.png")]) == 0
    assert "no CJK font" not in capsys.readouterr().err
    assert "猫" in texts and "激光点" in texts


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_step_without_stdin_runs_through(monkeypatch, capsys, lang):
    monkeypatch.setattr(sys, "stdin", None)  # what Python sets when fd 0 is closed
    assert cli_main(["demo", "--step", "--lang", lang]) == 0
    cap = capsys.readouterr()
    assert "④" in cap.out and demo.TEXT[lang]["press"].strip() not in cap.out
    assert cap.err.strip().splitlines() == [demo.TEXT[lang]["no_pause"]]


def test_step_when_reading_stdin_fails_midway(capsys):
    calls = []

    def lost(prompt):  # input() with sys.stdin gone
        calls.append(prompt)
        raise RuntimeError("input(): lost sys.stdin")

    buf = io.StringIO()
    assert demo.run(lang="en", step=True, file=buf, input_fn=lost) == 0
    assert len(calls) == 1  # it stops asking after the first failure
    assert "④" in buf.getvalue()
    assert capsys.readouterr().err.strip().splitlines() == [demo.TEXT["en"]["no_pause"]]


@pytest.mark.parametrize("stdin", ["closed", "devnull"])
def test_step_cli_with_closed_stdin(stdin):
    redirect = "<&-" if stdin == "closed" else "</dev/null"
    cmd = f'exec "{sys.executable}" -m attn_fast demo --step --lang en {redirect}'
    r = subprocess.run(
        ["sh", "-c", cmd],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    assert r.returncode == 0, r.stderr
    assert "④" in r.stdout and "lost sys.stdin" not in r.stderr
    assert r.stderr.strip().splitlines() == [demo.TEXT["en"]["no_pause"]]


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("causal", [False, True])
def test_step_numbers_run_in_order(lang, causal):
    """① ② ③ ④ each start a line once, in that order (the observations are a. and b.)."""
    buf = io.StringIO()
    demo.run(lang=lang, causal=causal, file=buf)
    marks = [
        line.lstrip()[0]
        for line in buf.getvalue().splitlines()
        if line.lstrip()[:1] in set("①②③④⑤")
    ]
    assert marks == ["①", "②", "③", "④"]


def test_zh_text_uses_full_width_punctuation():
    buf = io.StringIO()
    demo.run(lang="zh", causal=True, file=buf)
    texts = [buf.getvalue(), *_demo_plot.PLOT_TEXT["zh"].values()]
    han = "[\u3400-\u9fff]"  # ideographs (not the full-width punctuation itself)
    ascii_next_to_cjk = re.compile(rf"{han}[:,;?!()]|[:,;?!()]{han}")
    for text in texts:
        for line in text.splitlines():
            assert not ascii_next_to_cjk.search(line), line
    assert "attention：猫" in buf.getvalue()


def _bad_plot_paths(tmp_path):
    (tmp_path / "adir.png").mkdir()
    paths = {
        "missing folder": tmp_path / "nonexistent" / "x.png",
        "bad extension": tmp_path / "x.xyz",
        "no extension": tmp_path / "x",
        "a folder": tmp_path / "adir.png",
    }
    if os.path.isdir("/proc/self"):
        paths["not writable"] = "/proc/attn_fast_demo.png"  # even root cannot create files in /proc
    return paths


def test_plot_bad_paths_fail_first(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for why, path in _bad_plot_paths(tmp_path).items():
        assert cli_main(["demo", "--plot", str(path)]) == 2, why
        cap = capsys.readouterr()
        assert cap.out == "", why  # nothing of the walk-through
        (line,) = cap.err.strip().splitlines()
        assert line.startswith(f"error: --plot {path}"), (why, line)
        assert "Traceback" not in cap.err
        with pytest.raises(ValueError, match="--plot"):
            demo.run(plot=str(path), file=io.StringIO())
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.xyz").exists()


def test_plot_bad_path_cli_subprocess(tmp_path):
    pytest.importorskip("matplotlib")
    r = subprocess.run(
        [sys.executable, "-m", "attn_fast", "demo", "--plot", "/nonexistent/x.png"],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "error: --plot /nonexistent/x.png: folder /nonexistent does not exist"
    ]


def test_plot_other_formats(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.svg"
    assert cli_main(["demo", "--lang", "en", "--plot", str(path)]) == 0
    assert path.read_text()[:200].lstrip().startswith("<?xml")
    capsys.readouterr()
