"""``hf-relpos generate``: continue a prompt with a trained folder's model, streaming to the terminal."""

from __future__ import annotations

import sys

from .common import load_folder, position_table
from .errors import UserError


def generate_text(folder: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 40,
                  seed: int = 0, quiet: bool = False) -> str:
    """Sample (greedy at ``temperature`` 0) up to ``max_new_tokens`` after ``prompt``; the whole text, written to
    stdout as it comes and flushed (``quiet`` too: a run interrupted into a file keeps what it wrote; ``quiet``
    leaves out special tokens and the blank line). An absolute scheme stops at the end of its position table, and
    says so on stderr."""
    import torch
    from transformers import GenerationConfig, TextStreamer

    if not prompt.strip():
        raise UserError("--prompt is empty: give some text to continue")
    model, tokenizer = load_folder(folder)
    # The command's own settings, not the folder's generation_config.json: beams (which the streamer refuses), extra
    # sequences or token ids of another type there made generate fail with a traceback.
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False, return_token_type_ids=False)
    prompt_length = inputs["input_ids"].shape[1]
    new_tokens, table = max_new_tokens, position_table(model.config)
    if table is not None and prompt_length + new_tokens > table:
        if prompt_length >= table:
            raise UserError(
                f"--prompt is {prompt_length} tokens, and the {model.config.position_encoding} position table "
                f"holds {table}: give a shorter prompt"
            )
        new_tokens = table - prompt_length
    # TextStreamer prints each piece with flush=True, and a newline at the end
    streamer = TextStreamer(tokenizer, skip_special_tokens=True) if quiet else TextStreamer(tokenizer)
    torch.manual_seed(seed)
    output = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=top_k if temperature > 0 else None,
        use_cache=True,
        streamer=streamer,
    )
    text = tokenizer.decode(output[0], skip_special_tokens=True)
    if not quiet:
        print("")
    if new_tokens < max_new_tokens:
        print(
            f"hf-relpos generate: stopped after {new_tokens} new tokens: the {model.config.position_encoding} "
            f"position table holds {table} positions",
            file=sys.stderr,
        )
    return text


def generate_command(args) -> int:
    generate_text(args.folder, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, seed=args.seed, quiet=args.quiet)
    return 0
