"""``python -m hf_relpos.cli ...``: the ``hf-relpos`` console script, without the script.

The parser is the top-level ``hf_relpos_cli`` (it imports no torch); the commands are :mod:`hf_relpos.commands`.
"""

if __name__ == "__main__":
    import sys

    from hf_relpos_cli import main

    sys.exit(main())
