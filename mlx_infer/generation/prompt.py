"""Prompts to token ids and back, with the checks that give a user one line saying what is wrong: a string, a
list of chat messages (through the model's chat template) or token ids.

    prompts = PromptCodec(tokenizer, vocab_size=49152)
    ids = prompts.fitting([{"role": "user", "content": "Hi"}], context_length=8192)  # room for one token after it
    text = prompts.decode(ids)
"""

import numbers
from collections.abc import Iterable
from typing import Any, List, Optional, Sequence, Union

from ..errors import MlxInferError
from ..tools import formats

Messages = Sequence[dict]
Prompt = Union[str, Messages, Sequence[int]]


def check_unicode(text: str) -> None:
    """Raise MlxInferError for text the tokenizer cannot take: a lone surrogate, which is how Python keeps
    bytes that are not UTF-8 (a command-line argument or stdin in another encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MlxInferError(f"the prompt is not valid UTF-8 text (an undecodable byte at character {e.start}); "
                            "convert it to UTF-8 first (e.g. with iconv)") from None


class PromptCodec:
    """A model's prompts: encode (chat template, checks), decode.

    Args:
        tokenizer: the model's mlx-lm TokenizerWrapper.
        vocab_size: rows of the model's logits (token ids must be below it).
    """

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def fitting(self, prompt: Prompt, context_length: int, system: Optional[str] = None,
                chat_template: bool = True, tools: Any = None) -> List[int]:
        """`encode`, and check that at least one token fits after the prompt in the context window
        (context_length tokens).

        Raises:
            MlxInferError: as `encode`, or a prompt that fills the context window.
        """
        prompt_ids = self.encode(prompt, system, chat_template, tools)
        if len(prompt_ids) >= context_length:
            raise MlxInferError(
                f"the prompt has {len(prompt_ids)} tokens but the context window is {context_length}; shorten it"
            )
        return prompt_ids

    def encode(self, prompt: Prompt, system: Optional[str] = None, chat_template: bool = True,
               tools: Any = None) -> List[int]:
        """Prompt token ids.

        Args:
            prompt: a string, a list of chat messages ({"role", "content"}; assistant messages may carry
                OpenAI `tool_calls`, {"role": "tool", "tool_call_id", "content"} gives a call's result), or
                token ids.
            system: a system prompt, put first (chat template only).
            chat_template: apply the model's chat template to a string prompt (when it has one).
            tools: the request's ToolPlan (mlx_infer.tools), None without tools: rendered by the template
                when it supports tools, else as the generic form's system message (docs/structured.md).

        Raises:
            MlxInferError: empty prompt, bad messages, text that is not valid Unicode (bytes that were not
                UTF-8, kept by Python as lone surrogates), token ids outside the vocabulary, or a system
                prompt without a chat template.
        """
        if system is not None and not isinstance(system, str):
            raise MlxInferError(f"the system prompt must be a string, got {type(system).__name__}")
        if isinstance(prompt, str):
            check_unicode(prompt)
            if not prompt.strip():
                raise MlxInferError("the prompt is empty; give some text")
            if not (chat_template and self.tokenizer.has_chat_template):
                if tools is not None:
                    raise MlxInferError("tools need a chat template, and this model has none (or "
                                        "--no-chat-template was given)")
                if system:
                    raise MlxInferError("a system prompt needs a chat template, and this model has none (or --no-chat-template was given)")
                return list(self.tokenizer.encode(prompt))
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, dict):
            raise MlxInferError("a chat prompt is a list of messages: wrap the message in a list ([{...}])")
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
            raise MlxInferError(f"the prompt must be a string, a list of chat messages or a list of token ids "
                                f"(ints), got {type(prompt).__name__}")
        items: List[Any] = list(prompt)
        if not items:
            raise MlxInferError("the prompt is empty; give some text")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return self.checked_ids(items)
        return self._chat(items, system, tools)

    def _chat(self, items: List[Any], system: Optional[str], tools: Any = None) -> List[int]:
        """The token ids of chat messages through the model's chat template, the generation prompt added (and
        the tools: `tools`' plan, or only tool calls and results in the history)."""
        if not all(isinstance(m, dict) for m in items):
            raise MlxInferError("a list prompt must hold token ids (ints) or chat messages (dicts with 'role' and "
                                "'content'), not a mix or other values")
        for m in items:
            content = m.get("content")
            if content is None and m.get("tool_calls"):
                continue  # an assistant message that only calls tools
            if "role" not in m or not isinstance(content, str):
                raise MlxInferError("each chat message must be a dict with 'role' and 'content' (a string)")
            check_unicode(content)
        if system:
            check_unicode(system)
        if not self.tokenizer.has_chat_template:
            raise MlxInferError("this model has no chat template; pass a plain string prompt")
        if tools is not None or any(m.get("tool_calls") or m.get("role") == "tool" for m in items):
            return self._tool_chat(items, system, tools)
        if system:
            items = [{"role": "system", "content": system}] + [m for m in items if m["role"] != "system"]
        return list(self.tokenizer.apply_chat_template(items, add_generation_prompt=True))

    def _tool_chat(self, items: List[dict], system: Optional[str], tools: Any) -> List[int]:
        """Chat messages with tools (a ToolPlan or None) or tool calls in their history: the template's own
        tools rendering when it supports tools, else the generic form (tools.formats)."""
        native = tools.format.native if tools is not None else formats.template_has_tools(self.tokenizer)
        if native:
            if system:
                items = [{"role": "system", "content": system}] + [m for m in items if m["role"] != "system"]
            messages = formats.native_history(items)
            extra = {"tools": tools.tools} if tools is not None else {}
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra))
        if system is None:
            system = next((m["content"] for m in items if m["role"] == "system"), None)
        if tools is not None:
            system = tools.system(system)
        messages = formats.generic_history([m for m in items if m["role"] != "system"])
        if system:
            messages = [{"role": "system", "content": system}] + messages
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included: the inverse of `encode` for a plain string prompt.

        Raises:
            MlxInferError: an id that is not an int in the model's vocabulary.
        """
        try:
            ids = None if isinstance(token_ids, (str, bytes)) else list(token_ids)
        except TypeError:
            ids = None
        if ids is None:
            raise MlxInferError(f"decode takes a list of token ids (ints), got {type(token_ids).__name__}")
        return self.tokenizer.decode(self.checked_ids(ids))

    def checked_ids(self, ids: List) -> List[int]:
        """ids as ints, or MlxInferError naming the first that is not an int or not in 0..vocab_size - 1."""
        odd = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if odd is not None:
            raise MlxInferError(f"token ids must be ints, got {odd!r} ({type(odd).__name__})")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise MlxInferError(f"token id {bad!r} is outside the model's vocabulary (0..{self.vocab_size - 1})")
        return [int(t) for t in ids]
