"""The command line as a new user meets it: bench / bench --quick output, threads, plot legend,
install hints, the program name in --help, and short reprs.

Every bench run here uses `--tiny` (tiny shapes, one repeat, short probes):
the figures mean nothing, only the printed text and the files are checked.
No timing is asserted.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from attn_fast.__main__ import main as cli_main
from attn_fast.__main__ import prog_name
from attn_fast._bench import cases, common, measure, prefill, suite, tables
from attn_fast.variants import LinearAttentionState, linear_attention

FORBIDDEN = ("issue", "NOT met", "[met]", "targets", "'.[bench]'")


def _env(**extra):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", **extra}
    return env


def _sections(text):
    """{thread count: lines of its section} for the suite's '== N thread(s)' sections."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"== (\d+) thread\(s\)", line)
        if m:
            cur = out.setdefault(int(m.group(1)), [])
        elif line.startswith("=="):
            cur = None
        elif cur is not None:
            cur.append(line)
    return out


def _limit_lines(text):
    """{thread count: [lines that state an FMA peak for it]} over the whole output."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"(?:--|==) (\d+) thread\(s\).*FMA peak", line)
        if m:
            out.setdefault(int(m.group(1)), []).append(line)
    return out


def _suite(tmp_path, capsys, *args):
    assert (
        suite.main(
            ["--quick", "--tiny", "--impls", "attn_fast", "numpy", "--out", str(tmp_path), *args]
        )
        == 0
    )
    text = capsys.readouterr().out
    (path,) = glob.glob(str(tmp_path / "suite-tiny-*.json"))
    with open(path) as f:
        return text, json.load(f)


# --------------------------------------------------------------------------- threads


def test_suite_honours_omp_num_threads(tmp_path):
    """OMP_NUM_THREADS=1 python -m attn_fast bench --quick: one section, at 1 thread."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "attn_fast",
            "bench",
            "--quick",
            "--tiny",
            "--impls",
            "attn_fast",
            "numpy",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
        env=_env(OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr
    assert list(_sections(r.stdout)) == [1], r.stdout
    with open(glob.glob(str(tmp_path / "suite-tiny-*.json"))[0]) as f:
        res = json.load(f)
    assert {row["threads"] for row in res["results"]} == {1}
    for word in FORBIDDEN:
        assert word not in r.stdout, word


def test_plain_bench_honours_omp_num_threads():
    r = subprocess.run(
        [sys.executable, "-m", "attn_fast", "bench", "--tiny", "--no-numpy"],
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
        env=_env(OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"\bthreads 1\b", r.stdout), r.stdout
    assert "FMA peak on 1 thread(s)" in r.stdout


def test_plain_bench_threads_option(capsys):
    assert prefill.main(["--tiny", "--threads", "1", "--no-numpy"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\bthreads 1\b", out)
    rows = [x for x in out.splitlines() if re.match(r"\s*1\s+2\s+64\s+16", x)]
    assert len(rows) == len(prefill.TINY_CASES)
    assert len([x for x in out.splitlines() if "FMA peak" in x]) == 1  # one peak, used by every row
    for word in FORBIDDEN:
        assert word not in out, word


def test_suite_threads_option_and_one_peak_per_section(tmp_path, capsys):
    from attn_fast import get_num_threads

    before = get_num_threads()
    text, res = _suite(tmp_path, capsys, "--threads", "1", "2")
    assert get_num_threads() == before  # the run restores the thread count
    assert list(_sections(text)) == [1, 2]
    assert {row["threads"] for row in res["results"]} == {1, 2}
    # each section's limits are stated exactly once, and they are the ones the % were computed from
    limits = _limit_lines(text)
    assert sorted(limits) == [1, 2]
    for nt, lines in limits.items():
        assert len(lines) == 1, lines
        peak = float(re.search(r"FMA peak (\d+) GFLOP/s", lines[0]).group(1))
        assert peak == pytest.approx(res["limits"][str(nt)]["fma_peak_gflops"], abs=0.5)
        for row in res["results"]:
            a = row["impls"]["attn_fast"]
            if row["threads"] == nt and row["case"]["kind"] != "decode":
                assert a["pct_limit"] == pytest.approx(
                    100 * a["gflops"] / res["limits"][str(nt)]["fma_peak_gflops"]
                )
    # only one '%' figure per row and implementation in the whole output
    rows = [x for x in text.splitlines() if re.match(r"prefill \(1,2,64,16\)\s+\|", x)]
    assert len(rows) == 4  # each section's live row, then its line in the % table
    assert len([x for x in rows if "%" in x]) == 2
    for word in FORBIDDEN:
        assert word not in text, word


def test_bad_options_exit_2(tmp_path, capsys):
    for argv in (["--threads", "0", "--tiny"], ["--repeats", "0", "--tiny"]):
        with pytest.raises(SystemExit) as e:
            prefill.main(argv)
        assert e.value.code == 2
    for argv in (
        ["--quick", "--tiny", "--threads", "0"],
        ["--quick", "--tiny", "--cases", "no such case"],
    ):
        with pytest.raises(SystemExit) as e:
            suite.main([*argv, "--out", str(tmp_path)])
        assert e.value.code == 2
    capsys.readouterr()


# --------------------------------------------------------------------------- plot legend


def test_plot_legend_lists_only_what_was_measured(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _text, res = _suite(tmp_path, capsys, "--threads", "1")
    assert glob.glob(str(tmp_path / "suite-tiny-*.png"))
    # pretend onnxruntime and torch were asked for but skipped every case (not installed)
    for row in res["results"]:
        row["impls"]["onnxruntime"] = {"skipped": "onnxruntime/onnx not installed"}
        row["impls"]["torch"] = {"skipped": "torch not installed"}
    assert tables.measured_impls(res) == ["attn_fast", "numpy"]
    fig = tables.plot_figure(res)
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["attn_fast", "numpy"]
    # a peer measured on one case only is in the legend
    res["results"][0]["impls"]["torch"] = {**res["results"][0]["impls"]["numpy"]}
    fig = tables.plot_figure(res)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "attn_fast",
        "numpy",
        "torch",
    ]


# --------------------------------------------------------------------------- install hints


def test_install_hint_names_the_package(monkeypatch, tmp_path, capsys):
    real = common.import_peer
    monkeypatch.setattr(
        common,
        "import_peer",
        lambda name: None if name in ("torch", "onnxruntime") else real(name),
    )
    suite.main(
        [
            "--quick",
            "--tiny",
            "--threads",
            "1",
            "--impls",
            "attn_fast",
            "torch",
            "onnxruntime",
            "--out",
            str(tmp_path),
        ]
    )
    assert prefill.main(["--tiny", "--threads", "1", "--no-numpy"]) == 0
    out = capsys.readouterr().out
    hints = [line for line in out.splitlines() if "pip install" in line]
    assert all("pip install 'attn_fast[bench]'" in line for line in hints)
    # torch and onnxruntime in the suite, torch in bench (and matplotlib's plot note where it is
    # missing)
    assert sum("torch not installed" in line for line in hints) == 2
    assert sum("onnxruntime not installed" in line for line in hints) == 1
    assert "'.[bench]'" not in out


# --------------------------------------------------------------------------- program name, reprs


def test_help_uses_the_invoked_program_name(monkeypatch, capsys):
    assert prog_name("/usr/local/bin/attn-fast") == "attn-fast"
    assert prog_name("/x/site-packages/attn_fast/__main__.py") == "python -m attn_fast"
    monkeypatch.setattr(sys, "argv", ["/venv/bin/attn-fast", "--help"])
    assert cli_main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: attn-fast COMMAND")
    for cmd in ("demo", "bench"):
        with pytest.raises(SystemExit):
            cli_main([cmd, "--help"])
        assert f"usage: attn-fast {cmd}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["bench", "--quick", "--help"])
    assert "usage: attn-fast bench --full|--quick" in capsys.readouterr().out


def test_console_script_help():
    script = os.path.join(os.path.dirname(sys.executable), "attn-fast")
    if not os.path.exists(script):
        pytest.skip("the attn-fast console script is not installed next to this Python")
    r = subprocess.run(
        [script, "--help"], capture_output=True, check=False, text=True, timeout=120, env=_env()
    )
    assert r.returncode == 0 and r.stdout.startswith("usage: attn-fast COMMAND"), r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "attn_fast", "--help"],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m attn_fast COMMAND"), r.stdout


def test_linear_attention_state_repr_is_short(rng):
    q, k, v = (rng.standard_normal((2, 8, 300, 64)).astype(np.float32) for _ in range(3))
    _, state = linear_attention(q, k, v, causal=True, return_state=True)
    text = repr(state)
    assert text == str(state)
    assert (
        text
        == "LinearAttentionState(kv (2, 8, 64, 64) float64, k_sum (2, 8, 64) float64, length=300)"
    )
    assert repr(state.copy()) == text
    odd = LinearAttentionState(
        kv=[[1.0]], k_sum=None, length=0
    )  # not arrays: still a short repr, no error
    assert repr(odd) == "LinearAttentionState(kv list, k_sum NoneType, length=0)"


# --------------------------------------------------------------------------- 16-bit rows


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_suite_dtype_adds_16bit_rows(tmp_path, capsys, dtype):
    """bench --dtype bf16|fp16: each case again in that dtype, right after its float32 row;
    attn_fast checked and timed, the float32-only NumPy peer skipped; torch timed when installed."""
    impls = ["attn_fast", "numpy"] + (["torch"] if common.import_peer("torch") else [])
    assert (
        prefill.main(
            [
                "--tiny",
                "--threads",
                "1",
                "--dtype",
                dtype,
                "--impls",
                *impls,
                "--no-memory",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    (path,) = glob.glob(str(tmp_path / "suite-tiny-*.json"))
    with open(path) as f:
        res = json.load(f)
    names = [r["name"] for r in res["results"]]
    plain = [c.name for c in cases.tiny_cases()]
    assert names == [n for p in plain for n in (p, f"{p} {dtype}")]
    for row in res["results"]:
        a = row["impls"]["attn_fast"]
        assert "median_s" in a and a["oracle_max_abs_err"] < 0.05
        if row["case"]["dtype"] == dtype:
            assert row["impls"]["numpy"] == {"skipped": "float32 only"}
            if "torch" in impls:
                assert "speedup_attn_fast" in row["impls"]["torch"]
            if row["case"]["kind"] == "decode":  # 2 bytes per K/V element
                assert (
                    cases.Case(**row["case"]).kv_bytes * 2
                    == cases.Case(**{**row["case"], "dtype": "fp32"}).kv_bytes
                )
        assert row["name"] in text
    for word in FORBIDDEN:
        assert word not in text, word


# --------------------------------------------------------------------------- timing


def test_time_interleaved_warms_after_the_pause(monkeypatch):
    """After each cooldown pause an implementation runs untimed for WARM_S before its timed
    call (an idle VM wakes up slowly); cooldown=False pauses and warms nothing; long calls
    (>= WARM_MAX_S) are not warmed once one has been timed."""
    monkeypatch.setattr(measure, "COOLDOWN_DEFAULT_S", 0.0)
    monkeypatch.setattr(measure, "WARM_S", 0.02)
    clock = {"t": 0.0}
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(measure.time, "sleep", lambda s: None)
    calls = {"short": 0, "long": 0}

    def make(name, seconds):
        def fn():
            calls[name] += 1
            clock["t"] += seconds

        return fn

    fns = {"short": make("short", 0.005), "long": make("long", 0.3)}
    samples = measure.time_interleaved(fns, repeats=3, warmup=0)
    assert samples["short"] == pytest.approx([0.005] * 3)
    assert samples["long"] == pytest.approx([0.3] * 3)
    # short: 4 untimed calls (0.02 s) + 1 timed per round; long: 1 untimed call in the
    # first round only (its length is not known before), then timed calls alone
    assert calls == {"short": 3 * 5, "long": 1 + 3}
    calls.update(short=0, long=0)
    measure.time_interleaved(fns, repeats=3, warmup=0, cooldown=False)
    assert calls == {"short": 3, "long": 3}
