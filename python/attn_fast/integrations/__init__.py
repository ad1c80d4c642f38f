"""Adapters that plug attn_fast into other libraries.

``attn_fast.integrations.transformers``: a Hugging Face transformers attention
backend (``attn_implementation="attn_fast"``); needs ``pip install attn_fast[transformers]``.
``attn_fast.integrations.transformers_cache``: ``AttnFastCache``, a transformers ``Cache``
backed by one ``attn_fast.KVCache`` per layer (re-exported by the module above).

Submodules import their library only when imported themselves.
"""
