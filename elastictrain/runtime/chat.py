"""Rows into token ids and labels: plain text (loss on every token) or chat (loss on the assistant's tokens only).

A chat row is rendered with the tokenizer's own chat template, or FALLBACK_TEMPLATE when it has none, one turn at a
time: the text up to an assistant turn (rendered with the generation prompt) is the prompt, labelled -100; the
text the turn adds is the response, labelled with its token ids. Each piece is tokenized on its own, so the
labels fall exactly on the response whatever the tokenizer merges across a boundary. A sample's first label is
always -100: nothing before it in a packed sequence belongs to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from elastictrain.config import DataConfig
from elastictrain.errors import ConfigError, DataError
from elastictrain.runtime.rows import Row, text_of

log = logging.getLogger(__name__)

IGNORE = -100
"""The label of a token the loss skips (torch's cross_entropy ignore_index)."""

FALLBACK_TEMPLATE = (
    "{{ bos_token or '' }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token or '' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""For a tokenizer without a chat template: `<|role|>`, a newline, the content, then (after an assistant's turn)
the end-of-sequence token, and a newline; the generation prompt is `<|assistant|>` and a newline."""


@dataclass(frozen=True)
class Encoded:
    """One sample: token ids and their labels (IGNORE where the loss skips a token)."""

    input_ids: np.ndarray
    labels: np.ndarray


def load_tokenizer(directory: str, field: str) -> Any:
    """A transformers tokenizer from a local directory (never downloaded); `field` names the config field."""
    from transformers import AutoTokenizer

    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{field}={directory!r} is not a directory; point it at a local directory holding "
                          f"tokenizer.json / tokenizer_config.json")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{field}={directory!r} holds no tokenizer.json or tokenizer_config.json; save the "
                          f"tokenizer there (tokenizer.save_pretrained) or set data.tokenizer to where it is")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}={directory!r}: transformers cannot load a tokenizer from it ({e})") from None


class RowEncoder:
    """Encodes the rows of one dataset under `cfg.format` with `tokenizer`."""

    def __init__(self, tokenizer: Any, cfg: DataConfig):
        self.tok, self.cfg = tokenizer, cfg
        self.template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
        if cfg.format == "chat" and not getattr(tokenizer, "chat_template", None):
            log.info("the tokenizer has no chat template; using elastictrain's fallback (docs/finetuning.md)")

    def encode(self, row: Row, n: int) -> Encoded:
        if self.cfg.format == "text":
            return self._text(text_of(row[self.cfg.text_field], [f"row {n}", repr(self.cfg.text_field)]))
        return self._chat(self.messages(row, n), n)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def _text(self, text: str) -> Encoded:
        ids = list(self.tok(text)["input_ids"])  # the tokenizer's own BOS (if it adds one)
        if self.tok.eos_token_id is not None:
            ids.append(self.tok.eos_token_id)
        return _encoded(ids, list(ids))

    def messages(self, row: Row, n: int) -> list[dict[str, str]]:
        c = self.cfg
        if c.messages_field in row:
            msgs = row[c.messages_field]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in msgs):
                raise DataError(f"row {n}: column {c.messages_field!r} (data.messages_field) must be a list of "
                                f"{{'role': ..., 'content': ...}}")
            return [{"role": str(m["role"]), "content": text_of(m["content"], [f"row {n}", "content"])}
                    for m in msgs]
        return [{"role": "user", "content": text_of(row[c.prompt_field], [f"row {n}", repr(c.prompt_field)])},
                {"role": "assistant", "content": text_of(row[c.response_field], [f"row {n}", repr(c.response_field)])}]

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def _chat(self, messages: list[dict[str, str]], n: int) -> Encoded:
        ids: list[int] = []
        labels: list[int] = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], True)
            full = self.render(messages[:i + 1], False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise DataError(f"row {n}: the chat template does not render turn by turn (a conversation's "
                                f"text up to a turn is not a prefix of the whole); set a template that does, "
                                f"or remove the tokenizer's chat_template to use the fallback")
            head, answer = self._ids(prompt[len(done):]), self._ids(full[len(prompt):])
            ids += head + answer
            labels += [IGNORE] * len(head) + answer
            done = full
        if not any(label != IGNORE for label in labels):
            raise DataError(f"row {n}: no assistant turn with content to learn from; every chat row needs one")
        return _encoded(ids, labels)


def _encoded(ids: list[int], labels: list[int]) -> Encoded:
    out = np.asarray(labels, dtype=np.int64)
    if len(out):
        out[0] = IGNORE
    return Encoded(np.asarray(ids, dtype=np.int64), out)


def encode_rows(rows: list[Row], tokenizer: Any, cfg: DataConfig, vocab_size: int) -> list[Encoded]:
    """Every row encoded; a token id the model's embedding cannot hold is one line naming the fix."""
    encoder = RowEncoder(tokenizer, cfg)
    samples = [encoder.encode(row, n) for n, row in enumerate(rows)]
    top = max((int(s.input_ids.max()) for s in samples if len(s.input_ids)), default=-1)
    if top >= vocab_size:
        raise ConfigError(f"the tokenizer produced token id {top} but the model's vocab_size is {vocab_size}; "
                          f"use the model's own tokenizer (data.tokenizer) or set model.overrides.vocab_size >= "
                          f"{len(tokenizer)}")
    return samples
