"""Preference pairs (a prompt, a chosen and a rejected completion) tokenized as TRL's ``DPOTrainer`` tokenizes them.

A record is in one of TRL's formats, told apart record by record:

* standard: ``{"prompt": str, "chosen": str, "rejected": str}``;
* conversational: ``{"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}``, each
  message ``{"role", "content"}`` (roles as ``ChatDataset`` reads them: ``human``, ``gpt``, ``model``... too);
* implicit prompt: ``{"chosen": ..., "rejected": ...}``, both whole conversations or both strings, the prompt being
  their common beginning exactly as TRL's ``extract_prompt`` takes it (with its quirks: when one is a prefix of the
  other, or they are equal, the last common element or character goes to the completions; a space before the place
  they part goes to the completions too).

``columns`` names other fields (``{"chosen": "preferred", "rejected": "dispreferred", "role": "speaker"}``). Records
come from a ``.json``, ``.jsonl`` or ``.parquet`` file or a directory of them (``waypoint.data.records``).

Tokenization is TRL 1.16's ``tokenize_fn``: a conversation's prompt is rendered with the generation prompt and the
prompt followed by each completion is rendered whole (``ChatTemplate``), each tokenized as
``apply_chat_template(tokenize=True)`` does (the template writes its own BOS); a standard record's text is tokenized
as ``tokenizer(text)`` does (BOS first when the tokenizer has one), each completion ending with EOS (TRL's
``add_eos``). The prompt's ids are those the prompt alone and each prompt + completion share
(``common_prefix_length``), each completion's ids the rest of its prompt + completion. Then ``max_prompt_length``
(optional) keeps the prompt's last tokens, a pair whose prompt alone has ``max_length`` tokens or more is dropped
(TRL drops it) and each completion is cut to ``max_length`` minus the prompt's length (TRL's ``keep_start``).

Every record is checked, rendered and tokenized when the file is read, so a malformed record stops the run before
its first step in one line naming its file, record and field (``skip_bad_records`` counts it out instead).
"""

from __future__ import annotations

from array import array
from pathlib import Path

from torch.utils.data import Dataset

from waypoint.text.chat_template import ChatTemplate, load_chat_template
from waypoint.data.chat_dataset import read_messages
from waypoint.data.records import column_names, converted, Skipped

COLUMN_KEYS = ("prompt", "chosen", "rejected", "role", "content")
PAIR_KEYS = ("prompt", "chosen", "rejected")


class PreferenceDataset(Dataset):
    """Chosen/rejected pairs from a local file (or directory), tokenized when read, as TRL's DPOTrainer does.

    Args:
        source: the data file, or a directory of data files.
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer``.
        max_length: the most tokens of prompt + completion; completions are cut from the right to fit, and pairs
            whose prompt alone has this many tokens are dropped.
        max_prompt_length: None, or the most prompt tokens: longer prompts keep their last ones.
        template: None for the checkpoint's own chat template (read only when a record is a conversation); else a
            built-in name (``chatml``, ``llama3``) or a ``.jinja`` file.
        columns: field names of other layouts: ``prompt``, ``chosen``, ``rejected``, ``role``, ``content``.
        skip_bad_records: leave malformed records (and records the template refuses) out, counted and noted
            once, instead of stopping; a template that runs past its limits stops the run whatever this says.

    Attributes:
        where: ``where[i]`` is the file and record pair ``i`` came from.
        template: the chat template (None when none was named and every record is a standard one).
        prompt_format: the template conversations were rendered with (None when no record is a conversation): the
            run writes it beside every checkpoint, as the SFT recipes write theirs (``training.run_data``).
        truncated_prompts, truncated_completions, dropped, skipped: pairs whose prompt was cut to
            ``max_prompt_length``, pairs with a completion cut to ``max_length``, pairs dropped (the prompt fills
            ``max_length``), malformed records left out.
    """

    def __init__(self, source: str | Path, tokenizer, max_length: int, max_prompt_length: int | None = None,
                 template: str | None = None, columns: dict[str, str] | None = None,
                 skip_bad_records: bool = False) -> None:
        columns = column_names(columns, COLUMN_KEYS)
        if not _positive_int(max_length):
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
        if max_prompt_length is not None and not _positive_int(max_prompt_length):
            raise ValueError(f"max_prompt_length must be a positive integer or null, got {max_prompt_length!r}")
        self.source = Path(source)
        self.tokenizer = tokenizer
        self.columns = columns
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self._template_name = template
        # A named template is read now (a wrong name stops the run whatever the data); the checkpoint's own only
        # when a record is a conversation: standard records need none.
        self.template: ChatTemplate | None = load_chat_template(tokenizer, template) if template is not None else None
        self._rendered = False  # a conversation was rendered with the template
        self.where: list[str] = []
        self._ids: dict[str, list[array]] = {key: [] for key in PAIR_KEYS}
        self.truncated_prompts = self.truncated_completions = self.dropped = self.skipped = 0
        skipped = Skipped()
        pairs = converted(self.source, lambda record, where: self._tokenize(*self._pair(record, where)), skip_bad_records,
                          skipped)
        try:
            for where, (prompt, chosen, rejected) in pairs:
                self._add(prompt, chosen, rejected, where)
        except _TemplateMissing as e:  # no template for conversations: ChatDataset's error, never skipped
            raise e.__cause__ from None
        self.skipped = skipped.count
        first_error = skipped.first
        note = self._note(first_error)
        if note:
            print(f"note: {self.source}: {note}")
        if not self.where:
            why = (f" ({self.dropped} dropped: the prompt alone has max_length={max_length} tokens or more)"
                   if self.dropped else "")
            raise ValueError(f"{self.source}: no usable preference pairs{why}")

    # Records -> (prompt, chosen, rejected) --------------------------------------------------------------------

    def _pair(self, record, where: str) -> tuple:
        """The record's (prompt, chosen, rejected): three strings, or three lists of ``{"role", "content"}``."""
        data = record.data
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        names = {key: self.columns.get(key, key) for key in PAIR_KEYS}
        for key in ("chosen", "rejected"):
            if names[key] not in data:
                raise ValueError(f"{where}: missing key {names[key]!r}")
        chosen, rejected = data[names["chosen"]], data[names["rejected"]]
        prompt = data.get(names["prompt"])
        if prompt is None:  # implicit prompt: the common beginning of two conversations, or of two strings
            for key, value in (("chosen", chosen), ("rejected", rejected)):
                if not isinstance(value, (str, list)):
                    raise ValueError(f"{where}: {names[key]!r} must be a string or a list of messages, got "
                                     f"{type(value).__name__}")
            if type(chosen) is not type(rejected):
                raise ValueError(f"{where}: {names['chosen']!r} and {names['rejected']!r} must both be strings or both "
                                 f"lists of messages, got {type(chosen).__name__} and {type(rejected).__name__}")
            for key, value in (("chosen", chosen), ("rejected", rejected)):
                if not value:
                    raise ValueError(f"{where}: {names[key]!r} is empty")
            if isinstance(chosen, list):
                chosen = self._messages(chosen, names["chosen"], where)
                rejected = self._messages(rejected, names["rejected"], where)
            if chosen[0] != rejected[0]:
                what = "message" if isinstance(chosen, list) else "character"
                raise ValueError(f"{where}: no prompt in {names['chosen']!r} and {names['rejected']!r}: their first "
                                 f"{what}s differ, and no {names['prompt']!r} is given")
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
            if isinstance(prompt, list):
                if not prompt:  # one message each, the same
                    raise ValueError(f"{where}: no prompt in {names['chosen']!r} and {names['rejected']!r}: they are one "
                                     f"message each, and no {names['prompt']!r} is given")
                self._check_completions(chosen, rejected, names, where, implicit=True)
            return prompt, chosen, rejected
        if isinstance(prompt, str):
            for key, value in (("chosen", chosen), ("rejected", rejected)):
                if not isinstance(value, str):
                    raise ValueError(f"{where}: {names[key]!r} must be a string, as {names['prompt']!r} is, got "
                                     f"{type(value).__name__}")
                if not value:
                    raise ValueError(f"{where}: {names[key]!r} is empty")
            return prompt, chosen, rejected
        if not isinstance(prompt, list):
            raise ValueError(f"{where}: {names['prompt']!r} must be a string or a list of messages, got "
                             f"{type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"{where}: {names['prompt']!r} is an empty list of messages")
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, list):
                raise ValueError(f"{where}: {names[key]!r} must be a list of messages, as {names['prompt']!r} is, got "
                                 f"{type(value).__name__}")
            if not value:
                raise ValueError(f"{where}: {names[key]!r} is empty")
        prompt = self._messages(prompt, names["prompt"], where)
        chosen = self._messages(chosen, names["chosen"], where)
        rejected = self._messages(rejected, names["rejected"], where)
        self._check_completions(chosen, rejected, names, where, implicit=False)
        return prompt, chosen, rejected

    def _messages(self, turns: list, field: str, where: str) -> list[dict[str, str]]:
        return read_messages(turns, where, self.columns.get("role", "role"), self.columns.get("content", "content"), field)

    @staticmethod
    def _check_completions(chosen: list[dict], rejected: list[dict], names: dict[str, str], where: str,
                           implicit: bool) -> None:
        for key, messages in (("chosen", chosen), ("rejected", rejected)):
            for n, message in enumerate(messages, start=1):
                if message["role"] != "assistant":
                    after = " after the prompt they share" if implicit else ""
                    raise ValueError(f"{where}: {names[key]!r}: message {n}{after} has role {message['role']!r}; a "
                                     "completion is assistant messages only")
            if not any(message["content"] for message in messages):
                raise ValueError(f"{where}: {names[key]!r} is empty (no assistant message has content)")

    # Tokenization and truncation --------------------------------------------------------------------------------

    def _tokenize(self, prompt, chosen, rejected) -> tuple[list[int], list[int], list[int]]:
        """TRL's ``tokenize_fn``: (prompt ids, chosen ids, rejected ids), the prompt's those the three share."""
        if isinstance(prompt, list):
            template = self._chat_template()
            self._rendered = True
            prompt_ids = self._encode_rendered(template.render(prompt, add_generation_prompt=True))
            prompt_chosen_ids = self._encode_rendered(template.render(prompt + chosen))
            prompt_rejected_ids = self._encode_rendered(template.render(prompt + rejected))
        else:
            prompt_ids = self.tokenizer.encode(prompt, add_bos=True)
            prompt_chosen_ids = self._encode_with_eos(prompt + chosen)
            prompt_rejected_ids = self._encode_with_eos(prompt + rejected)
        prompt_len = min(common_prefix_length(prompt_ids, prompt_chosen_ids),
                         common_prefix_length(prompt_ids, prompt_rejected_ids))
        return prompt_ids[:prompt_len], prompt_chosen_ids[prompt_len:], prompt_rejected_ids[prompt_len:]

    def _chat_template(self) -> ChatTemplate:
        if self.template is None:  # the checkpoint's own, read at the first conversation; its absence is not the record's
            try:
                self.template = load_chat_template(self.tokenizer, self._template_name)
            except ValueError as e:
                raise _TemplateMissing(str(e)) from e
        return self.template

    def _encode_rendered(self, text: str) -> list[int]:
        return list(self.tokenizer.encode_with_offsets(text)[0])

    def _encode_with_eos(self, text: str) -> list[int]:
        """``tokenizer(text + eos_token)`` when ``text`` does not end with the EOS text already (TRL's ``add_eos``):
        the text's ids, BOS first, then EOS (the EOS text, a special token, is split off before the rest is read)."""
        eos_text = self.tokenizer.special_tokens.get("eos_token")
        if eos_text and text.endswith(eos_text):
            text = text[: -len(eos_text)]
        return self.tokenizer.encode(text, add_bos=True, add_eos=True)

    def _add(self, prompt: list[int], chosen: list[int], rejected: list[int], where: str) -> None:
        if self.max_prompt_length is not None and len(prompt) > self.max_prompt_length:
            prompt = prompt[-self.max_prompt_length:]  # the end of the prompt, next to the completion, is kept
            self.truncated_prompts += 1
        if len(prompt) >= self.max_length:  # nothing of the completions would be left to train on
            self.dropped += 1
            return
        room = self.max_length - len(prompt)
        if len(chosen) > room or len(rejected) > room:
            chosen, rejected = chosen[:room], rejected[:room]
            self.truncated_completions += 1
        for key, ids in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            self._ids[key].append(array("i", ids))  # 4 bytes an id: vocabularies are far below 2**31
        self.where.append(where)

    def _note(self, first_error: str | None) -> str:
        parts = []
        if self.truncated_prompts:
            parts.append(f"cut {self.truncated_prompts} prompt(s) to their last max_prompt_length="
                         f"{self.max_prompt_length} tokens")
        if self.truncated_completions:
            parts.append(f"cut the completions of {self.truncated_completions} pair(s) to max_length={self.max_length} "
                         "tokens with their prompt")
        if self.dropped:
            parts.append(f"dropped {self.dropped} pair(s) whose prompt alone has max_length={self.max_length} tokens "
                         "or more")
        if self.skipped:
            parts.append(f"skipped {self.skipped} malformed record(s) (skip_bad_records); first: {first_error}")
        return "; ".join(parts)

    @property
    def prompt_format(self) -> ChatTemplate | None:
        """The template conversations were rendered with: the output's, so it is prompted as it trained (None when
        every record is a standard one: no template rendered them)."""
        return self.template if self._rendered else None

    # Items ------------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {key: self._ids[key][index].tolist() for key in PAIR_KEYS}


class _TemplateMissing(Exception):
    """No chat template for a conversation: the configuration's fault, never skipped (not a ValueError)."""


def extract_prompt(chosen, rejected) -> tuple:
    """TRL's ``extract_prompt``: (prompt, chosen, rejected) from two strings or message lists, the prompt their
    longest common beginning, as TRL takes it (``chosen`` and ``rejected`` not empty)."""
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove space before the prompt
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def common_prefix_length(ids, other_ids) -> int:
    """The number of leading ids ``ids`` and ``other_ids`` share (TRL's ``common_prefix_length``)."""
    length = 0
    for token, other in zip(ids, other_ids):
        if token != other:
            break
        length += 1
    return length


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
