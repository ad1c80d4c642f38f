"""Adapters that plug attn_fast into other libraries.

``attn_fast.integrations.transformers``: a Hugging Face transformers attention
backend (``attn_implementation="attn_fast"``); needs ``pip install attn_fast[transformers]``.

Submodules import their library only when imported themselves.
"""
