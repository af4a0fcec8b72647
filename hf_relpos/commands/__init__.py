"""The ``hf-relpos`` commands, one module per command family.

- :mod:`.train`: ``train`` and ``eval`` (:func:`~.train.train_model` with :class:`~.train.TrainOptions`);
- :mod:`.generate`: ``generate``;
- :mod:`.compare`: ``compare`` and its table (:func:`~.compare.compare` with :class:`~.compare.CompareOptions`);
- :mod:`.lengthgen`: ``lengthgen`` (the synthetic tasks are :mod:`hf_relpos.lengthgen`);
- :mod:`.inspect`: ``inspect``;
- :mod:`.t5`: ``validate-t5`` and ``convert-t5``;
- :mod:`.serve`: ``serve`` (Transformers' OpenAI-compatible server; the app needs the ``serve`` extra: :mod:`.serve_app`
  on Transformers 5.25+, :mod:`.serve_app_524` before, both checking requests with :mod:`.serve_requests`);
- reporting apart: :mod:`.plotting` (the comparison figure), :mod:`.model_card` (cards from ``model_cards/``);
- :mod:`.common` (model folders: what may be written where, loading one) and :mod:`.errors`.

Each ``*_command(args)`` turns the parsed namespace into a typed call; the parser, which imports no torch, is the
top-level ``hf_relpos_cli`` (the console script), and nothing here imports it.
"""
