"""Developer and CI sessions: ``nox -l`` lists them, ``nox -s NAME`` runs one.

    nox -s tests          the README's test command (pip install '.[test]' && python -m pytest)
    nox -s isa            the whole suite once per other ISA this CPU runs (ATTN_FAST_ISA)
    nox -s sanitizers     ASan + UBSan build, the whole suite under LD_PRELOAD
    nox -s fuzz           libFuzzer harness for 60 s (nox -s fuzz -- 300); needs clang++
    nox -s lint           ruff check, ruff format --check, clang-format, cython-lint
    nox -s docs           the API reference and guides (Sphinx, warnings are errors) into build/docs
    nox -s wheel          build the wheel, install it in a fresh venv, run the demo outside the tree
    nox -s arm            aarch64 under QEMU: cross build, the CI subset on neon and neon_bf16
                          (tools/arm/emulate.sh; nox -s arm -- --subset all for the whole suite)

``.ci/run`` runs them all, in that order after ``wheel``. Everything comes from PyPI.

The suite runs twice with the same packages (``tests`` then ``isa``), so both use one
virtualenv, ``.nox/.cache/suite``, made here: torch is installed into it once, not once per
session. The other sessions get their own nox virtualenvs (no torch). Every build passes
``ATTN_FAST_WERROR=ON`` (set ``ATTN_FAST_WERROR=0`` in the environment to build without it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"  # nox.project.dependency_groups
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "isa", "lint"]

ROOT = Path(__file__).resolve().parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
# The optional dependencies the interop, transformers and plot tests need (they skip without
# them): the CPU torch wheel and transformers as pinned in the `transformers` extra, and
# matplotlib >= 3.11 (the demo's plots and their CJK-font checks).
SUITE_EXTRAS = ["torch==2.13.0", "transformers>=5.24,<6", "matplotlib>=3.11"]
ISA_PROBE = """
import attn_fast as af
runs, built = list(af._core.available_isas()), list(af._core.compiled_isas())
print("ISA paths: CPU", af._config.cpu_model(), "| default", af.get_isa(), "| runs here:", *runs)
untested = [i for i in built if i not in runs] or ["none"]
print("  compiled but NOT runnable on this CPU (untested here):", *untested)
print("RUNS", af.get_isa(), *runs)
"""


def _werror() -> str:
    """ON unless ATTN_FAST_WERROR is 0/off/no: every build of these sessions, the fuzz one too."""
    off = os.environ.get("ATTN_FAST_WERROR", "1").strip().lower() in ("0", "off", "no")
    return "OFF" if off else "ON"


def _build_flags() -> list[str]:
    """pip -C options of every build of the package made by these sessions."""
    return ["-C", f"cmake.define.ATTN_FAST_WERROR={_werror()}"]


def _suite_python(session: nox.Session) -> str:
    """The shared suite virtualenv's python, created (and its extras installed) on first use."""
    env = session.cache_dir / "suite"
    py = env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    if not py.exists():
        session.run(sys.executable, "-m", "venv", str(env), external=True)
        session.run(str(py), "-m", "pip", "install", "-q", "--upgrade", "pip", external=True)
    # pip returns at once when they are already there
    session.run(str(py), "-m", "pip", "install", "-q", *SUITE_EXTRAS, external=True)
    return str(py)


def _install_tree(session: nox.Session, py: str, spec: str = ".[test]") -> None:
    session.run(str(py), "-m", "pip", "install", "-q", spec, *_build_flags(), external=True)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The README's test command, with torch, transformers and matplotlib installed."""
    py = _suite_python(session)
    _install_tree(session, py)
    session.run(py, "-m", "pytest", *session.posargs, external=True)


@nox.session(venv_backend="none", requires=["tests"])
def isa(session: nox.Session) -> None:
    """The whole suite once per ISA path this CPU runs, forced with ATTN_FAST_ISA.

    The default path (the fastest this CPU has) is the one ``tests`` ran; each other path
    runs the whole suite again. What this CPU cannot run is printed, so a reader of the
    log knows what went untested.
    """
    py = _suite_python(session)
    _install_tree(session, py)  # a no-op rebuild when `tests` just installed this tree
    probe = subprocess.run([py, "-c", ISA_PROBE], check=True, capture_output=True, text=True)
    lines = probe.stdout.splitlines()
    print("\n".join(line for line in lines if not line.startswith("RUNS ")))
    default, *runs = next(line for line in lines if line.startswith("RUNS ")).split()[1:]
    for name in runs:
        if name == default:
            session.log(f"ATTN_FAST_ISA={name}: the default path, run by the tests session")
            continue
        session.log(f"ATTN_FAST_ISA={name}: whole suite")
        session.run(
            py,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *session.posargs,
            env={"ATTN_FAST_ISA": name},
            external=True,
        )


@nox.session
def sanitizers(session: nox.Session) -> None:
    """ASan + UBSan build (ATTN_FAST_SANITIZE), the whole suite under LD_PRELOAD.

    torch is not installed here (its own allocator and threads under ASan are not what is
    being tested): the tests that need it skip; every kernel and Python path runs.
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        session.error("the sanitizer session needs gcc (its libasan.so and libubsan.so)")
    session.install(
        ".[test]",
        "-C",
        "cmake.define.ATTN_FAST_SANITIZE=ON",
        "-C",
        "build-dir=build/asan",
        *_build_flags(),
    )
    libs = [
        subprocess.run(
            [gcc, f"-print-file-name={lib}"], check=True, capture_output=True, text=True
        ).stdout.strip()
        for lib in ("libasan.so", "libubsan.so")
    ]
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={
            "LD_PRELOAD": ":".join(libs),
            "ASAN_OPTIONS": "detect_leaks=0:allocator_may_return_null=1",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        },
    )


def _has_libfuzzer(session: nox.Session) -> bool:
    cxx = os.environ.get("FUZZ_CXX", "clang++")
    if shutil.which(cxx) is None:
        return False
    probe = 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) {return 0;}'
    out = Path(session.create_tmp()) / "fuzz-probe"
    res = subprocess.run(
        [cxx, "-x", "c++", "-fsanitize=fuzzer", "-", "-o", str(out)],
        input=probe,
        text=True,
        capture_output=True,
    )
    return res.returncode == 0


@nox.session
def fuzz(session: nox.Session) -> None:
    """The libFuzzer harness (CMake preset `fuzz`, target fuzz_forward), 60 s by default.

    ``nox -s fuzz -- SECONDS``. Skipped, saying so, when clang++ with libFuzzer is missing.
    """
    if not _has_libfuzzer(session):
        session.skip("clang++ with libFuzzer not installed (Debian: apt-get install clang)")
    session.install("cmake>=3.21", "ninja")
    seconds = session.posargs[0] if session.posargs else "60"
    args = f"-DATTN_FAST_WERROR={_werror()} {os.environ.get('FUZZ_CMAKE_ARGS', '')}".strip()
    session.run("bash", "fuzz/run.sh", seconds, external=True, env={"FUZZ_CMAKE_ARGS": args})


def _tracked(*patterns: str, under: list[str]) -> list[str]:
    """Tracked files matching the patterns, below any of the paths `under` ('.' = all)."""
    out = subprocess.run(
        ["git", "ls-files", "--", *patterns], cwd=ROOT, check=True, capture_output=True, text=True
    )
    roots = [Path(p).resolve() for p in under]
    files = [f for f in out.stdout.split() if f]
    return [f for f in files if any((ROOT / f).resolve().is_relative_to(r) for r in roots)]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, clang-format --dry-run -Werror and cython-lint.

    Strict on the whole tree; ``nox -s lint -- PATH...`` (or ATTN_FAST_LINT_PATHS="PATH ...")
    restricts every check to the tracked files under those paths.
    The tool versions are pinned once, in pyproject.toml's ``lint`` dependency group;
    .pre-commit-config.yaml must pin the same.
    """
    pins = nox.project.dependency_groups(PYPROJECT, "lint")
    session.install(*pins)
    precommit = (ROOT / ".pre-commit-config.yaml").read_text()
    stale = [p for p in pins if not re.search(re.escape(p) + r"\b", precommit)]
    if stale:
        session.error(f".pre-commit-config.yaml does not pin {stale} (pyproject.toml does)")
    paths = session.posargs or os.environ.get("ATTN_FAST_LINT_PATHS", "").split() or ["."]
    checks = [["ruff", "check", *paths], ["ruff", "format", "--check", *paths]]
    for tool, patterns in (
        (["clang-format", "--dry-run", "-Werror"], ("*.cpp", "*.h", "*.hpp")),
        (["cython-lint"], ("*.pyx", "*.pxd")),
    ):
        files = _tracked(*patterns, under=paths)
        if files:
            checks.append([*tool, *files])
        else:
            session.log(f"{tool[0]}: no {'/'.join(patterns)} file under {' '.join(paths)}")
    failed = []
    for cmd in checks:  # every check runs, so one log shows every finding
        try:
            session.run(*cmd)
        except nox.command.CommandFailed:
            failed.append(" ".join(cmd[:2]))
    if failed:
        session.error(f"lint failed: {', '.join(failed)}")


@nox.session
def docs(session: nox.Session) -> None:
    """The API reference and guides (Sphinx), warnings as errors, into build/docs/html."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "docs"))
    session.install(".", *_build_flags())  # autodoc imports attn_fast (and its _core)
    out = ROOT / "build" / "docs"
    shutil.rmtree(out, ignore_errors=True)  # a full build each time: warnings are not cached
    strict = os.environ.get("ATTN_FAST_DOCS_WERROR", "1").strip().lower() not in ("0", "off", "no")
    if not strict:
        session.warn("ATTN_FAST_DOCS_WERROR=0: Sphinx warnings are printed, NOT treated as errors")
    session.run(
        "sphinx-build",
        *(["-W"] if strict else []),
        "--keep-going",
        "-b",
        "html",
        "-d",
        str(out / "doctrees"),
        *session.posargs,
        "docs",
        str(out / "html"),
    )


@nox.session(reuse_venv=False)  # a fresh venv: the wheel alone must be enough
def wheel(session: nox.Session) -> None:
    """Build the wheel, install it into a fresh venv and import it outside the source tree."""
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run(
        "python", "-m", "pip", "wheel", "-q", ".", "-w", str(dist), "--no-deps", *_build_flags()
    )
    wheels = sorted(dist.glob("attn_fast-*.whl"))
    if len(wheels) != 1:
        session.error(f"expected one attn_fast wheel in {dist}, found {wheels}")
    session.install(str(wheels[0]))
    outside = dist.parent  # not the source tree: the import must find the installed wheel
    with session.chdir(outside):
        session.run(
            "python",
            "-c",
            "import attn_fast as af, numpy as np; af.show_config(); "
            "x = np.ones((4, 8), np.float32); "
            "print(af.scaled_dot_product_attention(x, x, x).shape)",
        )
        session.run("python", "-m", "attn_fast", "demo", "--causal", silent=True)
        session.log("demo: runs from the wheel (NumPy only)")


@nox.session(venv_backend="none")
def arm(session: nox.Session) -> None:
    """aarch64 under QEMU user emulation (tools/arm/emulate.sh): an arm64 Debian root
    (debootstrap, cached in .arm/), a cross build with -Werror, the aarch64 objdump guard,
    and the CI subsets (tools/arm/ci_subset_<path>.txt) on neon (QEMU_CPU=neoverse-n1) and
    neon_bf16 (QEMU_CPU=max). Arguments go to the script (``-- --subset all``). Skips with
    a log line where the machine is not x86-64 Linux with apt-get and root or sudo.
    """
    session.run("bash", str(ROOT / "tools/arm/emulate.sh"), *session.posargs, external=True)
