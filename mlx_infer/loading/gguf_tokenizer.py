"""GGUF tokenizer metadata -> a Hugging Face fast tokenizer (no torch needed).

The vocabulary (BPE `gpt2` or SentencePiece `llama`), merges, special tokens and chat template
stored in a GGUF file's `tokenizer.*` keys are handed to transformers' GGUF tokenizer builders,
which rebuild the `tokenizers.Tokenizer` llama.cpp's convert script started from.
"""

from tokenizers import processors
from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)

from ..errors import UnsupportedModelError


def eos_token_ids(fields: dict, tokens: list) -> list:
    """End-of-generation token ids: EOS plus end-of-turn (EOT / EOM) tokens the metadata names.

    Gemma files name no EOT token, but their chat turns end with `<end_of_turn>`, which llama.cpp
    also treats as end of generation.
    """
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in fields and int(fields[key]) not in ids:
            ids.append(int(fields[key]))
    for name in ("<end_of_turn>", "<|eot_id|>", "<|im_end|>"):
        if name in tokens and tokens.index(name) not in ids:
            ids.append(tokens.index(name))
    return ids


def build_tokenizer(fields: dict) -> PreTrainedTokenizerFast:
    """Build the fast tokenizer a GGUF file describes.

    Args:
        fields: GGUF metadata as plain Python values ({key: int | float | str | list}).

    Returns:
        A `PreTrainedTokenizerFast` with bos/eos/unk/pad tokens and the chat template set.

    Raises:
        UnsupportedModelError: the file has no tokenizer or a vocabulary type transformers cannot build.
    """
    if "tokenizer.ggml.tokens" not in fields:
        raise UnsupportedModelError(
            "this GGUF file has no tokenizer (no tokenizer.ggml.tokens); use a GGUF that embeds its vocabulary"
        )
    arch = fields["general.architecture"]
    tokenizer_dict = {
        name: fields[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in fields
    }
    try:
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(
            f"cannot build the tokenizer of this GGUF file ({tokenizer_dict.get('tokenizer_type')!r} vocabulary): {e}"
        ) from e
    tokens = tokenizer_dict["tokens"]

    def token(key):
        token_id = fields.get(f"tokenizer.ggml.{key}")
        return tokens[int(token_id)] if token_id is not None and int(token_id) < len(tokens) else None

    bos = token("bos_token_id")
    # llama.cpp adds BOS when the file says so, and by default for SentencePiece vocabularies.
    add_bos = fields.get("tokenizer.ggml.add_bos_token", tokenizer_dict.get("tokenizer_type") == "llama")
    if add_bos and bos is not None:
        bos_id = int(fields["tokenizer.ggml.bos_token_id"])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=fields.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
