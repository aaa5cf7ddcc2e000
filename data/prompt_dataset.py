"""Prompt-only records for online RL (GRPO), in TRL's formats, tokenized as TRL 1.16's ``GRPOTrainer`` tokenizes them.

A record is ``{"prompt": str | [messages], <other fields>...}``:

* standard: the prompt a string, tokenized as ``tokenizer(text)`` does (BOS first when the tokenizer has one);
* conversational: the prompt a list of ``{"role", "content"}`` messages (roles as ``ChatDataset`` reads them),
  rendered with the chat template and its generation prompt and tokenized as ``apply_chat_template(tokenize=True)``
  does (the template writes its own BOS).

Every other field is a column: the reward functions get it by name, one value per completion (TRL's ``**kwargs``),
e.g. ``answer`` for ``waypoint.rewards.answer_match``. ``max_prompt_length`` (optional; TRL 1.16 has none) keeps a
longer prompt's last tokens. ``columns`` names other layouts (``{"prompt": "question", "role": "from"}``). Records come
from a ``.json``, ``.jsonl`` or ``.parquet`` file or a directory of them, and are all checked when the file is read:
a malformed one stops the run before its first step in one line naming its file, record and field
(``skip_bad_records`` counts it out instead).
"""

from __future__ import annotations

from array import array
from pathlib import Path

from torch.utils.data import Dataset

from waypoint.text.chat_template import ChatTemplate, load_chat_template
from waypoint.data.chat_dataset import read_messages
from waypoint.data.records import column_names, converted, Skipped

COLUMN_KEYS = ("prompt", "role", "content")


class PromptDataset(Dataset):
    """Prompts from a local file (or directory), tokenized when read; an item is ``{"prompt_ids", "prompt",
    "columns", "index"}`` (``prompt``: the record's prompt as given, string or messages, for the reward functions).

    Args:
        source: the data file, or a directory of data files.
        tokenizer: a ``waypoint.text.tokenizer.Tokenizer``.
        max_prompt_length: None, or the most prompt tokens: longer prompts keep their last ones.
        template: None for the checkpoint's own chat template (read only when a record is a conversation); else a
            built-in name (``chatml``, ``llama3``) or a ``.jinja`` file.
        columns: field names of other layouts: ``prompt``, ``role``, ``content``.
        skip_bad_records: leave malformed records out, counted and noted once, instead of stopping.
        tools: JSON-schema definitions of the tools the model may call (multi-turn RL: the recipe passes those of
            its ``tools`` and ``environment_factory``), rendered into conversational prompts as
            ``apply_chat_template(tools=...)`` renders them.
    """

    def __init__(self, source: str | Path, tokenizer, max_prompt_length: int | None = None,
                 template: str | None = None, columns: dict[str, str] | None = None,
                 skip_bad_records: bool = False, tools: list[dict] | None = None) -> None:
        columns = column_names(columns, COLUMN_KEYS)
        if hasattr(tools, "_metadata"):  # passed through a config: plain values for the template's sandbox
            from omegaconf import OmegaConf

            tools = OmegaConf.to_container(tools, resolve=True)
        self.tools = list(tools) if tools else None
        if max_prompt_length is not None and (isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int)
                                              or max_prompt_length < 1):
            raise ValueError(f"max_prompt_length must be a positive integer or null, got {max_prompt_length!r}")
        self.source, self.tokenizer, self.columns = Path(source), tokenizer, columns
        self.max_prompt_length = max_prompt_length
        self._template_name = template
        self.template: ChatTemplate | None = load_chat_template(tokenizer, template) if template is not None else None
        self._rendered = False
        self.where: list[str] = []
        self._ids: list[array] = []
        self._prompts: list = []
        self._columns: list[dict] = []
        self.truncated = 0
        skipped = Skipped()
        prompt_key = columns.get("prompt", "prompt")
        try:
            for where, (prompt, ids, rest) in converted(self.source, lambda r, w: self._read(r, w, prompt_key),
                                                        skip_bad_records, skipped):
                if max_prompt_length is not None and len(ids) > max_prompt_length:
                    ids, self.truncated = ids[-max_prompt_length:], self.truncated + 1
                self._ids.append(array("i", ids))
                self._prompts.append(prompt)
                self._columns.append(rest)
                self.where.append(where)
        except _TemplateMissing as e:
            raise e.__cause__ from None
        self.skipped = skipped.count
        notes = []
        if self.truncated:
            notes.append(f"cut {self.truncated} prompt(s) to their last max_prompt_length={max_prompt_length} tokens")
        if self.skipped:
            notes.append(f"skipped {self.skipped} malformed record(s) (skip_bad_records); first: {skipped.first}")
        if notes:
            print(f"note: {self.source}: {'; '.join(notes)}")
        if not self.where:
            raise ValueError(f"{self.source}: no usable prompts")

    def _read(self, record, where: str, prompt_key: str) -> tuple:
        data = record.data
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        if prompt_key not in data:
            raise ValueError(f"{where}: missing key {prompt_key!r} (a prompt-only record: {{\"prompt\": ..., "
                             "other fields for the reward functions}; columns: {prompt: <name>} for another name)")
        prompt = data[prompt_key]
        rest = {k: v for k, v in data.items() if k != prompt_key}
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where}: {prompt_key!r} is empty")
            return prompt, self.tokenizer.encode(prompt, add_bos=True), rest
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"{where}: {prompt_key!r} must be a string or a non-empty list of messages, got "
                             f"{type(prompt).__name__ if prompt != [] else 'an empty list'}")
        messages = self._messages(prompt, prompt_key, where)
        template = self._chat_template()
        self._rendered = True
        return messages, list(self.tokenizer.encode_with_offsets(template.render(messages, add_generation_prompt=True,
                                                                                 tools=self.tools))[0]), rest

    def _messages(self, turns: list, field: str, where: str) -> list[dict[str, str]]:
        messages = read_messages(turns, where, self.columns.get("role", "role"), self.columns.get("content", "content"),
                                 field)
        if messages[-1]["role"] == "assistant":
            raise ValueError(f"{where}: {field!r} ends with an assistant message; a prompt ends where the completion "
                             "is to begin")
        return messages

    def _chat_template(self) -> ChatTemplate:
        if self.template is None:
            try:
                self.template = load_chat_template(self.tokenizer, self._template_name)
            except ValueError as e:
                raise _TemplateMissing(str(e)) from e
        return self.template

    @property
    def prompt_format(self) -> ChatTemplate | None:
        """The template conversations were rendered with (None when every prompt is a string)."""
        return self.template if self._rendered else None

    @property
    def conversational(self) -> bool:
        """Whether prompts are conversations: completions then go to the reward functions as
        ``[{"role": "assistant", "content": text}]``, as TRL passes them."""
        return self._rendered

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, index: int) -> dict:
        return {"prompt_ids": self._ids[index].tolist(), "prompt": self._prompts[index],
                "columns": self._columns[index], "index": index}


class _TemplateMissing(Exception):
    """No chat template for a conversation: the configuration's fault, never skipped (not a ValueError)."""
