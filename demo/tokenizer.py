"""The demo tokenizer: a small byte-level BPE trained on the corpus's training split.

Why BPE rather than raw bytes: at equal CPU time a 2048-token BPE (~3 bytes per token)
lets each training step see about three times more text (a one-off trial here gave a
lower loss at equal CPU time).
Why byte-level: any string round-trips exactly, so the server can take arbitrary user
text. The result is an ordinary Hugging Face tokenizer folder that
``AutoTokenizer.from_pretrained(dir)`` loads offline.

Example::

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(pair.tokenizer)  # doctest: +SKIP
    >>> tok.decode(tok("def f(x):\\n    return x")["input_ids"])  # doctest: +SKIP
    'def f(x):\\n    return x'
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)
"""Trained first, so their ids are 0..3 in this order. A pad distinct from eos keeps
"is this position padding?" unambiguous for code that derives masks from token ids."""

CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nWrite each call as a JSON object with the function\\'s name and arguments within "
    "<tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n"
    "</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{{ ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n{\"name\": ' + "
    "(call['function']['name'] | tojson) + ', \"arguments\": ' + (call['function']['arguments'] | tojson) + "
    "'}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, with tools as Qwen2.5 and Hermes models see them (Hermes-style calls: the ``hermes``
tool-call parser reads them back): the tools' signatures in the system message, an assistant's
calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, a tool's result in a
``<tool_response>``. A conversation without tools, calls or tool results renders as plain
ChatML. The demo models never saw chat data, so chat replies are code-flavoured noise; the
template exists so /v1/chat/completions, tools included, has something real to render."""


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, model_max_length: int
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (specials included) on ``texts``.

    Training is deterministic for a given input order (the ``tokenizers`` BPE trainer
    breaks ties by pair order), which the demo pair's reproducibility relies on.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",
        # Generation pads on the left; the default "clean up" would rewrite " ." to "."
        # and break exact round-trips of source code.
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[int]:
    """All ``texts`` as one token stream, each followed by the eos id.

    Goes through the backend tokenizer's batch encoder: parallel, and free of the
    "longer than model_max_length" warnings that whole source files would trigger.
    """
    stream: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(tokenizer.eos_token_id)
    return stream
