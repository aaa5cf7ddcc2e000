"""Text in and out of a model: tokenizers (``tokenizer.json`` or ``tokenizer.model``), chat templates rendered in a
sandbox, where generation stops, and the files that make a checkpoint an inference bundle. Training data and
``recipes/generate.py`` both read text through here."""

from waypoint.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
