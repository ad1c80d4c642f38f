"""The type stubs of the compiled modules match the modules.

``_core.pyi`` (pybind11) and ``_cyloops.pyi`` (Cython) are read as they are
installed beside the extensions: every function in a stub exists in the
module and every public function of the module is in its stub, with the same
parameters (names, positional / keyword-only, which have defaults).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import types

import pytest

import attn_fast
from attn_fast import _core, _cyloops

PKG = pathlib.Path(attn_fast.__file__).parent


def stub_functions(name):
    path = PKG / f"{name}.pyi"
    assert path.is_file(), f"{path} is not installed with the package"
    tree = ast.parse(path.read_text())
    return {n.name: n.args for n in tree.body if isinstance(n, ast.FunctionDef)}


def arg_shape(args):
    """[(name, kind, has_default)] of an ast.arguments; positional-only
    parameters have no name that a caller could use, so none is compared."""
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    n_only = len(args.posonlyargs)
    out = [
        ("" if i < n_only else a.arg, "positional", i >= first_default)
        for i, a in enumerate(positional)
    ]
    if args.vararg is not None:
        out.append((args.vararg.arg, "*args", False))
    out += [(a.arg, "keyword", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        out.append((args.kwarg.arg, "**kwargs", False))
    return out


def pybind_args(fn):
    """The parameters pybind11 wrote on the first line of fn's docstring."""
    line = fn.__doc__.strip().splitlines()[0]
    args = ast.parse(f"def {line}: ...").body[0].args
    # Parameters bound without py::arg are named arg0, arg1, ...: positional only.
    unnamed = [a for a in args.args if re.fullmatch(r"arg\d+", a.arg)]
    args.posonlyargs, args.args = args.posonlyargs + unnamed, args.args[len(unnamed) :]
    return args


def signature_shape(fn):
    """arg_shape's form of inspect.signature(fn) (Cython functions carry one)."""
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "*args",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
        inspect.Parameter.VAR_KEYWORD: "**kwargs",
    }
    return [
        (p.name, kinds[p.kind], p.default is not inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
    ]


def module_functions(mod, private=False):
    return {
        n
        for n in dir(mod)
        if not n.startswith("__")
        and (private or not n.startswith("_"))
        and callable(getattr(mod, n))
        and not isinstance(getattr(mod, n), (types.ModuleType, type))
    }


def test_core_stub_names_match_the_module():
    stub = stub_functions("_core")
    real = module_functions(_core)
    assert set(stub) - real == set(), "in _core.pyi but not in the module"
    assert real - set(stub) == set(), "in the module but not in _core.pyi"


@pytest.mark.parametrize("name", sorted(module_functions(_core)))
def test_core_stub_signature_matches_pybind(name):
    stub = stub_functions("_core")
    if name not in stub:
        pytest.fail(f"_core.{name} has no stub")
    assert arg_shape(stub[name]) == arg_shape(pybind_args(getattr(_core, name)))


def test_cyloops_stub_matches_the_module():
    stub = stub_functions("_cyloops")
    real = module_functions(_cyloops, private=True)
    assert set(stub) == real
    for name in sorted(real):
        assert arg_shape(stub[name]) == signature_shape(getattr(_cyloops, name)), name


def test_arg_shape_tells_signatures_apart():
    # The comparison above can fail: a renamed, reordered, keyword-only or
    # defaulted parameter each change the shape.
    def shape(src):
        return arg_shape(ast.parse(src).body[0].args)

    base = shape("def f(a, b=1, *, c): ...")
    for other in (
        "def f(a, x=1, *, c): ...",
        "def f(b, a=1, *, c): ...",
        "def f(a, b=1, c=2): ...",
        "def f(a, b, *, c): ...",
        "def f(a, b=1, *, c=3): ...",
    ):
        assert shape(other) != base, other
    assert shape("def f(a: int, b: float = ..., *, c: str): ...") == base
    assert shape("def f(x, /, b=1, *, c): ...") == shape("def f(y, /, b=1, *, c): ...")


# The public API's annotations: every public function and method of these
# modules annotates each parameter and its return. kv_cache (KVCache,
# LayerCaches, merge_attention_states) is annotated with the KV-cache work.
ANNOTATED = [
    "attn_fast",
    "attn_fast.functional",
    "attn_fast.masks",
    "attn_fast.multihead",
    "attn_fast.transformer",
    "attn_fast.positional",
    "attn_fast.variants",
    "attn_fast.backward",
    "attn_fast.reference",
    "attn_fast.demo",
    "attn_fast._config",
    "attn_fast._dispatch",
    "attn_fast.torch",
    "attn_fast.distributed",
]
NOT_YET: set[str] = set()  # every public callable is annotated


def unannotated(fn):
    sig = inspect.signature(fn)
    out = [
        p.name
        for p in sig.parameters.values()
        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    if sig.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
        out.append("return")
    return out


def public_callables(mod):
    names = getattr(mod, "__all__", [n for n in dir(mod) if not n.startswith("_")])
    for n in names:
        obj = getattr(mod, n)
        if n in NOT_YET or inspect.ismodule(obj):
            continue
        if not getattr(obj, "__module__", "").startswith("attn_fast"):
            continue  # re-exported from numpy, typing, ...
        if inspect.isclass(obj):
            for an, a in vars(obj).items():
                f = a.__func__ if isinstance(a, (staticmethod, classmethod)) else a
                if inspect.isfunction(f) and (
                    not an.startswith("_") or an in ("__init__", "__call__")
                ):
                    yield f"{mod.__name__}.{n}.{an}", f
        elif inspect.isfunction(obj):
            yield f"{mod.__name__}.{n}", obj


@pytest.mark.parametrize("modname", ANNOTATED)
def test_public_api_is_annotated(modname):
    if modname in ("attn_fast.torch", "attn_fast.distributed"):
        pytest.importorskip("torch")
    mod = importlib.import_module(modname)
    missing = {name: m for name, f in public_callables(mod) if (m := unannotated(f))}
    assert missing == {}


def stub_tuple_return(name, fn_name):
    """The element annotations of a ``-> tuple[...]`` return in stub `name`, as source text."""
    tree = ast.parse((PKG / f"{name}.pyi").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn_name]
    ret = fn.returns
    assert isinstance(ret, ast.Subscript) and ast.unparse(ret.value) == "tuple", ast.unparse(ret)
    elts = ret.slice.elts if isinstance(ret.slice, ast.Tuple) else [ret.slice]
    return [ast.unparse(e) for e in elts]


def test_core_stub_tuple_returns_match_the_binding():
    """A tuple the stub promises has the length and element types the binding returns."""
    import numpy as np

    q = np.zeros((1, 1, 3, 4), np.float32)
    o = np.empty_like(q)
    calls = {
        "forward": lambda: _core.forward(q, q, q, o, scale=0.5),
        "cpu_signature": _core.cpu_signature,
    }
    for fn_name, call in calls.items():
        want = stub_tuple_return("_core", fn_name)
        got = call()
        assert isinstance(got, tuple) and len(got) == len(want), (fn_name, got, want)
        for value, ann in zip(got, want):
            assert type(value).__name__ == ann, (fn_name, value, ann)
