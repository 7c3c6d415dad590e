"""The tokenizer as toolkv uses it: the part of a Hugging Face tokenizer (`PreTrainedTokenizerFast`,
loaded with the model by model_loader.py) that the engine and the chat service call.

A structural type (`typing.Protocol`): any object with these members is one, so a test may pass
a tokenizer of its own. Optional attributes a tokenizer may lack (`all_special_ids`,
`added_tokens_decoder`, `bos_token_id`, `is_fast`, `backend_tokenizer`) are read with `getattr`
and a default where they are used, and are not part of the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    chat_template: Any  # the model's Jinja template: a string, named templates, or None

    def __call__(self, text: str, *, add_special_tokens: bool = ..., return_offsets_mapping: bool = ...,
                 split_special_tokens: bool = ...) -> Mapping[str, Any]:
        """The encoding of `text`: `input_ids`, and `offset_mapping` (each token's (start, end) in
        characters) when asked."""
        ...

    def __len__(self) -> int:
        """Token ids the tokenizer knows, added tokens included."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...

    def convert_ids_to_tokens(self, ids: int) -> str | None:
        """A token's piece as the vocabulary spells it (byte-level: `Ġ` for a space); None for an
        id past the vocabulary (the model's padding)."""
        ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def save_pretrained(self, save_directory: str | Path) -> Any: ...
