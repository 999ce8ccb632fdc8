"""A byte-level BPE tokenizer trained on the tool world, saved as a standard HF tokenizer.

Byte-level, so any string -- an unseen entity, another prompt format -- encodes.
Pre-tokenisation splits text into runs of letters, single digits, and runs of
everything else (spaces and punctuation together). Unlike GPT-2's split, a word
never carries its leading space, so an entity name is the same tokens in the
question (`of Velmora`) and in a JSON argument (`"Velmora"`), and digits are one
token each (as in Qwen2.5 and Llama 3): a value is copied from a tool response to
the next call token for token. JSON punctuation runs such as `": "` become single
tokens, which keeps the tool docs short. The control tags are added special
tokens, one id each; the saved `PreTrainedTokenizerFast` carries the ChatML template.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from toolcollapse.chat import CHAT_TEMPLATE, CONTROL_TAGS, ENDOFTEXT, IM_END

PRETOKENIZE_PATTERN = r"\p{L}+|\p{N}|[^\p{L}\p{N}]+"
DIGIT_RUNS_PATTERN = r"\p{L}+|\p{N}+|[^\p{L}\p{N}]+"  # ablation: numbers become multi-digit BPE chunks


def train_tokenizer(texts: Iterable[str], vocab_size: int, single_digits: bool = True) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    pattern = PRETOKENIZE_PATTERN if single_digits else DIGIT_RUNS_PATTERN
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(CONTROL_TAGS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
        additional_special_tokens=[t for t in CONTROL_TAGS if t not in (IM_END, ENDOFTEXT)],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
