import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

UNK, EOS = "[UNK]", "</s>"
# The tests' document i is the word f"w{i}" repeated, so every token names its document.
WORDS = [f"w{i}" for i in range(300)] + ["alpha", "beta", "gamma"]


def _word_tokenizer(eos: bool = True) -> PreTrainedTokenizerFast:
    """Word-level: "[UNK]" = 0, "</s>" = 1, WORDS[i] = i + 2; split on whitespace."""
    vocab = {UNK: 0, EOS: 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = WhitespaceSplit()
    if eos:
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNK, eos_token=EOS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNK)


@pytest.fixture(scope="session")
def make_tokenizer():
    """A fresh word-level test tokenizer per call: make_tokenizer(eos=True)."""
    return _word_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return _word_tokenizer()


@pytest.fixture
def count_tokenized(monkeypatch, tokenizer):
    """A list that collects every document the test tokenizer is asked to encode."""
    seen: list[str] = []
    original = type(tokenizer).__call__

    def counting(self, text, *args, **kwargs):
        seen.extend([text] if isinstance(text, str) else text)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    return seen
