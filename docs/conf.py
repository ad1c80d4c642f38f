"""Sphinx configuration: the API reference from the docstrings, the README's tours as pages.

Built by ``nox -s docs`` (warnings are errors: ``sphinx-build -W``); by hand:
``sphinx-build -W -b html docs build/docs/html`` with ``attn_fast`` installed and the
``docs`` dependency group of pyproject.toml (sphinx, myst-parser).
"""

from __future__ import annotations

import importlib.metadata

project = "attn_fast"
author = "the attn_fast authors"
copyright = "the attn_fast authors"  # noqa: A001  (Sphinx's name)
release = importlib.metadata.version("attn_fast")  # the installed package is what is documented
version = release

extensions = [
    "myst_parser",  # Markdown pages; the README's tours are included, not copied
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",  # one page per public module, found by walking the package
    "sphinx.ext.napoleon",  # the docstrings are numpydoc-style (Parameters / Returns)
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
templates_path = ["_templates"]
exclude_patterns = ["_build", "api/generated/*.md"]
root_doc = "index"

# The API pages: autosummary walks attn_fast (public modules only, not `_name`) and
# autodoc documents each module's public members (its __all__ where it has one), so a new
# public name or module appears without editing these docs.
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# The torch adapter and the transformers integration import their framework at import time;
# the docs build does not install torch (1 GB) to read their docstrings.
autodoc_mock_imports = ["torch", "transformers"]
# "more than one target found" (ref.python, the only warning of that subtype): the package
# re-exports names (attn_fast.LayerCaches is attn_fast.kv_cache.LayerCaches) and autodoc
# documents one object on both pages, so a bare type hint resolves to two equal targets.
suppress_warnings = ["ref.python"]

napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "alabaster"
html_static_path: list[str] = []
html_title = f"attn_fast {release}"
