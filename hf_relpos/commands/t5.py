"""``hf-relpos validate-t5`` and ``hf-relpos convert-t5``: T5 parity with the installed Transformers, and an
upstream T5 folder converted into an hf_relpos encoder-decoder folder."""

from __future__ import annotations

from pathlib import Path

from .common import RemoveIfEmptyOnFailure, check_conversion_output, one_line, read_json_object, weights_problem
from .errors import UserError
from .model_card import write_seq2seq_card


def validate_t5() -> bool:
    """T5's position buckets and bias against the installed Transformers' ``T5Attention`` (exactly), then whole
    converted models (:func:`_validate_t5_models`); prints what it checked. True when everything matches."""
    import torch
    import transformers
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    from ..position_terms_relpos import t5_position_bias, t5_relative_position_bucket

    torch.manual_seed(0)
    relative = torch.cat([torch.arange(-5000, 5001), torch.tensor([-(10**9), -(2**31 - 1), 10**6, 2**31 - 1])])
    cases = values = mismatches = 0
    max_error = 0.0
    for bidirectional in (True, False):
        for num_buckets in (4, 6, 8, 16, 31, 32, 33, 64, 128):
            exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
            for max_distance in sorted({exact + 1, 20, 64, 128, 500, 4096} - set(range(exact + 1))):
                ours = t5_relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
                theirs = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
                cases += 1
                values += relative.numel()
                mismatches += int((ours != theirs).sum())
                config = T5Config(
                    num_heads=3, d_model=12, d_kv=4, relative_attention_num_buckets=num_buckets,
                    relative_attention_max_distance=max_distance, is_decoder=not bidirectional,
                )
                attention = T5Attention(config, has_relative_attention_bias=True)
                for query_length, key_length, past in ((7, 7, 0), (1, 300, 299), (5, 2000, 1995), (3, 9, 100)):
                    expected = attention.compute_bias(query_length, key_length, past_seen_tokens=past)
                    got = t5_position_bias(
                        attention.relative_attention_bias.weight, query_length, key_length,
                        bidirectional=bidirectional, max_distance=max_distance, past_length=past,
                    )
                    cases += 1
                    values += expected.numel()
                    error = (got - expected).abs().max().item()
                    max_error = max(max_error, error)
                    mismatches += int((got != expected).sum())
    status = "OK" if mismatches == 0 else "MISMATCH"
    print(f"T5 parity with transformers {transformers.__version__} (torch {torch.__version__}): {status}")
    print(f"  cases: {cases}   values checked: {values:,}   mismatches: {mismatches}   max abs error: {max_error:g}")
    return mismatches == 0 and _validate_t5_models()


def _validate_t5_models() -> bool:
    """Whole models: small random upstream T5s of each kind, converted by ``from_t5``, on padded inputs."""
    from ..t5_conversion import LOGIT_TOLERANCE, T5_KINDS, from_t5, parity_holds, random_t5, t5_parity

    print(f"Whole converted models (hf_relpos.from_t5) against upstream T5ForConditionalGeneration, fp32, "
          f"tolerance {LOGIT_TOLERANCE:g} (relative to logits above 1):")
    ok = True
    for kind in T5_KINDS:
        for impl in ("eager", "sdpa"):
            upstream = random_t5(kind)
            upstream.set_attn_implementation(impl)
            result = t5_parity(upstream, from_t5(upstream, check=False))  # the check is reported, not raised
            passed = parity_holds(result)
            ok &= passed
            print(f"  {kind:<36} {impl:>5}: max |logit diff| {result['max_abs_logit_diff']:.2e} (logits up to "
                  f"{result['max_abs_logit']:.2f}), greedy {'identical' if result['greedy_identical'] else 'DIFFERENT'}, "
                  f"beam {'identical' if result['beam_identical'] else 'DIFFERENT'}  {'OK' if passed else 'MISMATCH'}")
    return ok


def convert_t5(src_folder: str, out_folder: str, *, overwrite: bool = False) -> dict:
    """A local upstream T5 folder (safetensors) as an hf_relpos encoder-decoder folder, with code and card; the
    converted model is checked against the upstream one on random padded inputs before anything is written.
    Returns that check's result (:func:`hf_relpos.t5_conversion.check_t5_parity`)."""
    import torch
    import transformers
    from safetensors import SafetensorError

    from ..t5_conversion import ENCODER_CLASSES, REFUSED_CLASSES, SEQ2SEQ_CLASSES, check_t5_parity, from_t5

    try:
        from huggingface_hub.errors import StrictDataclassError  # a config field of the wrong type
    except ImportError:  # pragma: no cover - older huggingface_hub
        StrictDataclassError = ValueError

    src, out = Path(src_folder), Path(out_folder)
    if not (src / "config.json").is_file():
        raise UserError(f"SRC_FOLDER {str(src)!r} holds no config.json: give a local folder saved by "
                        "T5ForConditionalGeneration.save_pretrained (nothing is downloaded)")
    if src.resolve() == out.resolve():
        raise UserError(f"OUT_FOLDER {str(out)!r} is SRC_FOLDER: give another folder (the source is never replaced)")
    # model_type first, from the JSON itself: T5Config would read another model's config.json into T5 fields and
    # fail on the first field of another type (a StrictDataclassFieldValidationError)
    raw = read_json_object(src / "config.json")
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    families = {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}
    refused = {"longt5": "LongT5"}
    if model_type in refused:
        raise UserError(f"SRC_FOLDER {str(src)!r} holds a {model_type!r} model, which convert-t5 does not convert: "
                        f"{REFUSED_CLASSES[refused[model_type]]}")
    if model_type not in families:
        raise UserError(f"SRC_FOLDER {str(src)!r} holds a {model_type!r} model; convert-t5 converts 't5' (T5, Flan-T5, "
                        "ByT5), 'mt5' and 'umt5' models")
    family = families[model_type]
    weights = [p for p in src.glob("*.safetensors") if p.is_file()]
    if isinstance(architectures, list) and architectures:
        given = OLD_NAMES.get(architectures[0], architectures[0])
    else:  # no architectures: an encoder's weights hold no decoder
        given = f"{family}ForConditionalGeneration" if _holds_a_decoder(weights) else f"{family}EncoderModel"
    allowed = [name for name in SEQ2SEQ_CLASSES + ENCODER_CLASSES if name.startswith(family)]
    if given not in allowed:
        raise UserError(f"SRC_FOLDER {str(src)!r} holds a {given!r} (config.json's architectures); convert-t5 converts "
                        f"{' and '.join(allowed)} for model type {model_type!r}")
    upstream_class = getattr(transformers, given)
    try:
        config = getattr(transformers, f"{family}Config").from_pretrained(src, local_files_only=True)
    except (OSError, ValueError, TypeError, StrictDataclassError) as error:
        raise UserError(f"SRC_FOLDER {str(src)!r}: its config.json cannot be read ({one_line(error)})") from error
    if not weights:
        raise UserError(f"SRC_FOLDER {str(src)!r} holds no .safetensors weights (pickled weights are not loaded)")
    empty = [p for p in weights if p.stat().st_size == 0]
    if empty:
        raise UserError(f"{empty[0]} is empty (0 bytes): the weights were never completely written")
    check_conversion_output(out, overwrite)  # before the work, not when the converted model is saved
    with RemoveIfEmptyOnFailure(out):
        try:
            _check_t5_fits(src, config, weights, upstream_class)
            upstream, info = upstream_class.from_pretrained(
                src, local_files_only=True, use_safetensors=True, output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below by name, instead of Transformers' RuntimeError
            )
        except SafetensorError as error:
            named = str(weights[0]) if len(weights) == 1 else f"SRC_FOLDER {str(src)!r}: one of its .safetensors files"
            raise UserError(f"{named} is damaged or truncated ({one_line(error)})") from error
        except (OSError, ValueError) as error:
            raise UserError(f"SRC_FOLDER {str(src)!r}: its weights cannot be loaded ({one_line(error)})") from error
        problem = weights_problem(info)
        if problem:  # converting freshly initialised weights would pass the parity check, silently
            raise UserError(f"SRC_FOLDER {str(src)!r}: its weights do not match its config.json: {problem}")
        upstream = upstream.float().eval()
        converted = from_t5(upstream, check=False)
        try:  # before anything is written: a model that differs from its source is refused, not recorded
            parity = check_t5_parity(upstream, converted)
        except ValueError as error:
            raise UserError(f"{src}: {error}; nothing written") from None
        except IndexError:  # (an encoder alone does not decode)
            # Upstream T5's own generate (the parity check decodes with it) indexes past its cache when the decoder
            # has more layers than the encoder (Transformers 5.21-5.24); the conversion cannot be checked.
            if config.num_decoder_layers <= config.num_layers:
                raise
            raise UserError(
                f"SRC_FOLDER {str(src)!r}: num_decoder_layers {config.num_decoder_layers} > num_layers "
                f"{config.num_layers}, and the installed Transformers' T5 cannot generate with a decoder deeper than "
                "its encoder, so the conversion cannot be checked against it; nothing written"
            ) from None
        out.mkdir(parents=True, exist_ok=True)
        converted.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model"):
            if (src / name).is_file():  # the source's tokenizer travels with the model
                (out / name).write_bytes((src / name).read_bytes())
        write_seq2seq_card(out, src, converted.config, parity, torch.__version__, source_class=given)
    if not converted.config.is_encoder_decoder:
        dropped = " (the decoder and output layer its weights also hold were left out)" if _holds_a_decoder(weights) else ""
        print(f"Converted {src} ({given}) -> {out}/: last_hidden_state within {parity['max_abs_logit_diff']:.1e} of "
              f"the source model at every real token (random padded inputs, fp32){dropped}")
        return parity
    print(f"Converted {src} -> {out}/: logits within {parity['max_abs_logit_diff']:.1e} of the source model "
          f"(random padded inputs, fp32); greedy {'identical' if parity['greedy_identical'] else 'DIFFERENT'}, "
          f"beam search {'identical' if parity['beam_identical'] else 'DIFFERENT'}")
    return parity


# Class names of config.json's `architectures` that Transformers renamed: the original T5 checkpoints (t5-small to
# t5-11b) name T5WithLMHeadModel.
OLD_NAMES = {"T5WithLMHeadModel": "T5ForConditionalGeneration"}


def _holds_a_decoder(weights: list) -> bool:
    """Whether the safetensors files hold a decoder (read from their headers alone)."""
    from safetensors import safe_open

    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as handle:
                if any(key.startswith("decoder.") for key in handle.keys()):
                    return True
        except Exception:  # noqa: BLE001 - a damaged file is reported where the weights are loaded
            continue
    return False


def _check_t5_fits(src: Path, config, weights: list, upstream_class) -> None:
    """A T5 config.json that asks for other or far more parameters than its weights hold is one line before
    anything is allocated (Transformers would allocate them at the config's size: 128 GB for vocab_size 1e9, and
    minutes to build num_layers 1e6). Reads the weights' headers and builds the model on the meta device with no
    more blocks than they hold."""
    import copy
    import math
    import re

    import torch
    from transformers.modeling_utils import load_state_dict

    from ..loading_relpos import MISSING_VALUES_FLOOR

    shapes = {}
    for file in weights:
        shapes.update((k, tuple(v.shape)) for k, v in load_state_dict(str(file), map_location="meta").items())
    built = copy.deepcopy(config)
    stacks = [("num_layers", "encoder")]
    if not upstream_class.__name__.endswith("EncoderModel"):
        stacks.append(("num_decoder_layers", "decoder"))
    for field, stack in stacks:
        held = len({m.group(1) for key in shapes if (m := re.match(rf"{stack}\.block\.(\d+)\.", key))})
        if getattr(config, field) > held:
            raise UserError(f"SRC_FOLDER {str(src)!r}: its weights do not match its config.json: {field}="
                            f"{getattr(config, field)} in config.json, {held} {stack} blocks in the weights")
    with torch.device("meta"):
        model = upstream_class(built)
    lacking = 0
    for name, tensor in model.state_dict().items():
        if name not in shapes:
            lacking += tensor.numel()
        elif shapes[name] != tuple(tensor.shape):
            raise UserError(f"SRC_FOLDER {str(src)!r}: its weights do not match its config.json: {name} "
                            f"{list(shapes[name])} in the file, {list(tensor.shape)} for config.json")
    allowed = max(sum(math.prod(shape) for shape in shapes.values()), MISSING_VALUES_FLOOR)
    if lacking > allowed:
        raise UserError(f"SRC_FOLDER {str(src)!r}: its weights do not match its config.json, which asks for {lacking:,} "
                        f"values the weights do not hold (more than {allowed:,})")


def validate_t5_command(args) -> int:
    return 0 if validate_t5() else 1


def convert_t5_command(args) -> int:
    convert_t5(args.src_folder, args.out_folder, overwrite=args.overwrite)
    return 0
