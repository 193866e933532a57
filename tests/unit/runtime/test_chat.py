"""Rows into token ids and labels: the chat template's prompt is masked, the response is learned."""

import numpy as np
import pytest

from elastictrain.config import DataConfig
from elastictrain.errors import ConfigError, DataError
from elastictrain.runtime.chat import FALLBACK_TEMPLATE, IGNORE, RowEncoder, encode_rows, load_tokenizer
from tests.fixtures.sft import CHAT_TEMPLATE, make_tokenizer

ROW = {"messages": [{"role": "system", "content": "answer please"},
                    {"role": "user", "content": "what is the cat"},
                    {"role": "assistant", "content": "a cat sat"},
                    {"role": "user", "content": "why"},
                    {"role": "assistant", "content": "the rain"}]}


@pytest.fixture(scope="module", params=["own template", "fallback"])
def tokenizer(request, tmp_path_factory):
    template = CHAT_TEMPLATE if request.param == "own template" else None
    return load_tokenizer(str(make_tokenizer(tmp_path_factory.mktemp("tok"), template)), "data.tokenizer")


def learned_text(tok, enc) -> list[str]:
    """The decoded runs of tokens whose labels are not IGNORE."""
    runs, cur = [], []
    for t, label in zip(enc.input_ids, enc.labels):
        if label == IGNORE:
            if cur:
                runs.append(tok.decode(cur))
            cur = []
        else:
            assert label == t, "a learned token's label is the token itself"
            cur.append(int(t))
    return runs + ([tok.decode(cur)] if cur else [])


def test_chat_loss_covers_exactly_the_assistant_turns(tokenizer):
    enc = RowEncoder(tokenizer, DataConfig(source="jsonl", path="x")).encode(ROW, 0)
    eos = tokenizer.eos_token
    tail = "\n" if tokenizer.chat_template is None else " "  # what each template writes after a turn
    assert learned_text(tokenizer, enc) == [f"a cat sat{eos}{tail}", f"the rain{eos}{tail}"]
    # the ids are the whole conversation as the template renders it
    text = tokenizer.apply_chat_template(ROW["messages"], chat_template=tokenizer.chat_template or FALLBACK_TEMPLATE,
                                         tokenize=False)
    assert tokenizer.decode(enc.input_ids) == text


def test_prompt_response_rows_are_a_user_and_an_assistant_turn(tokenizer):
    cfg = DataConfig(source="jsonl", path="x")
    a = RowEncoder(tokenizer, cfg).encode({"prompt": "tell me", "response": "good"}, 0)
    b = RowEncoder(tokenizer, cfg).encode({"messages": [{"role": "user", "content": "tell me"},
                                                         {"role": "assistant", "content": "good"}]}, 0)
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.labels, b.labels)
    assert learned_text(tokenizer, a)[0].startswith("good")


def test_text_rows_learn_every_token_but_the_first(tokenizer):
    enc = RowEncoder(tokenizer, DataConfig(source="jsonl", path="x", format="text")).encode({"text": "the cat"}, 0)
    assert enc.labels[0] == IGNORE and np.array_equal(enc.labels[1:], enc.input_ids[1:])
    assert enc.input_ids[-1] == tokenizer.eos_token_id


def test_a_chat_row_without_an_assistant_turn_is_one_line(tokenizer):
    with pytest.raises(DataError, match="row 3: no assistant turn"):
        RowEncoder(tokenizer, DataConfig(source="jsonl", path="x")).encode(
            {"messages": [{"role": "user", "content": "hi"}]}, 3)


def test_token_ids_beyond_the_models_vocabulary_are_refused(tokenizer):
    with pytest.raises(ConfigError, match="model.overrides.vocab_size"):
        encode_rows([{"prompt": "the cat", "response": "sat"}], tokenizer, DataConfig(source="jsonl", path="x"),
                    vocab_size=10)


def test_a_missing_tokenizer_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.tokenizer='/nonexistent' is not a directory"):
        load_tokenizer("/nonexistent", "data.tokenizer")
    with pytest.raises(ConfigError, match=r"^model.path=.* holds no tokenizer.json or tokenizer_config.json") as e:
        load_tokenizer(str(tmp_path), "model.path")
    assert "\n" not in str(e.value)
