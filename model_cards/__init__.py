"""The model-card templates, one ``<scheme>.md`` per position scheme and ``seq2seq.md`` for ``convert-t5``.

This folder is the data package ``hf_relpos.model_cards`` (``pyproject.toml`` maps it there, in a wheel and in an
editable install alike); :mod:`hf_relpos.commands.model_card` reads the templates with ``importlib.resources``.
"""
