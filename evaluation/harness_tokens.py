"""Text -> token ids exactly as lm-eval's ``hf`` backend (HFLM) gets them from transformers' tokenizer of the same
checkpoint, so that our loglikelihoods are over the same tokens as theirs.

transformers' ``encode(text)`` adds the special tokens of the tokenizer's post-processor (``tokenizer.json``'s
``post_processor``: Llama's and Gemma's ``<s>``/``<bos>`` before the text, nothing for Qwen's); HFLM passes
``add_special_tokens=False`` where a request asks for it, and its ``add_bos_token`` option rebuilds the
post-processor (``True``: the BOS alone; ``False``: nothing). Our tokenizer encodes the text without special
tokens, and the tokens of the post-processor are put around it here. A checkpoint with only a sentencepiece
``tokenizer.model`` gets a BOS where it has one, as transformers' sentencepiece tokenizers add it by default.

Generated text is decoded as transformers 5 decodes it: special tokens left out, and ``clean_up_tokenization_spaces``
of tokenizer_config.json (" ." -> ".", " n't" -> "n't" ...) applied except to BPE vocabularies, which transformers 5
leaves alone unless ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` says otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from waypoint.text.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, Tokenizer

PROBE = "a"  # any text: what the post-processor puts around it is what it puts around every text


def post_processor_tokens(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(the ids transformers puts before a text, those it puts after it) when it adds special tokens."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    path = Path(tokenizer.directory) / TOKENIZER_JSON if tokenizer.directory is not None else None
    if path is None or not path.is_file():
        return bos, []
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_file(str(path))
    bare = backend.encode(PROBE, add_special_tokens=False).ids
    full = backend.encode(PROBE, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return bos, []  # a post-processor that changes the text's own tokens: not one transformers ships


def cleans_up_spaces(tokenizer: Tokenizer) -> bool:
    """Whether transformers' ``decode`` cleans up spaces before punctuation for this checkpoint."""
    directory = Path(tokenizer.directory) if tokenizer.directory is not None else None
    config_file = directory / TOKENIZER_CONFIG if directory is not None else None
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file is not None and config_file.is_file() else {}
    if not config.get("clean_up_tokenization_spaces"):
        return False
    if config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
        return True
    vocabulary = directory / TOKENIZER_JSON  # without one (sentencepiece): converted to BPE, as most are
    return vocabulary.is_file() and json.loads(vocabulary.read_text(encoding="utf-8")).get("model", {}).get("type") != "BPE"


def clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


class HarnessTokens:
    """``encode(text, add_special_tokens)`` as HFLM's tokenizer does it, for ``add_bos_token`` None (the tokenizer's
    own special tokens), True (the BOS alone) or False (none)."""

    def __init__(self, tokenizer: Tokenizer, add_bos_token: bool | None = None) -> None:
        self.tokenizer = tokenizer
        if add_bos_token is None:
            self.prefix, self.suffix = post_processor_tokens(tokenizer)
        elif add_bos_token and tokenizer.bos_id is not None:
            self.prefix, self.suffix = [tokenizer.bos_id], []
        else:
            self.prefix, self.suffix = [], []
        self.clean_up = cleans_up_spaces(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_bos=False)
        return self.prefix + ids + self.suffix if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        """Generated ids as text, as HFLM decodes them."""
        text = self.tokenizer.decode(ids)
        return clean_up(text) if self.clean_up else text

    def text_of(self, name: str) -> str | None:
        """A named special token's text (``bos_token``, ``eos_token``), as transformers decodes its id."""
        return self.tokenizer.special_tokens.get(name)
