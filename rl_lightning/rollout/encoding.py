"""``PromptEncoder``: the token ids of an episode's first observation and of each observation after a turn.

A first observation is BOS + its tokens, or with ``use_chat_template`` a user message of the tokenizer's chat
template plus the generation prompt. An observation after a turn is its own tokens, or with the template the
part of the rendered conversation after the model's turn, so that a trajectory's ids are the template's
rendering of the whole conversation.
"""

from __future__ import annotations

from typing import Any


class PromptEncoder:
    """Turns the texts of an episode into ids with ``tokenizer`` (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer (its ``eos_token_id`` and ``pad_token_id`` are the rollout's).
        add_bos: prepend the tokenizer's BOS token to a first observation (when it has one; no template).
        use_chat_template: render observations as user messages of the tokenizer's chat template.
    """

    def __init__(self, tokenizer: Any, add_bos: bool = True, use_chat_template: bool = False) -> None:
        self.tokenizer, self.add_bos, self.use_chat_template = tokenizer, add_bos, use_chat_template

    def _template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def first(self, texts: list[str], messages: list[list[dict[str, str]] | None] | None = None) -> list[list[int]]:
        """The ids of each episode's first observation; with the chat template, a prompt's own chat ``messages``
        (a system prompt, earlier turns) are rendered in place of one user message holding its text."""
        tok = self.tokenizer
        rows: list[list[int]] = []
        for i, text in enumerate(texts):
            own = messages[i] if messages is not None else None
            if self.use_chat_template:
                conversation = own if own else [{"role": "user", "content": text}]
                rendered = self._template(conversation, add_generation_prompt=True)
                ids = tok(rendered, add_special_tokens=False)["input_ids"]
            else:
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if self.add_bos and tok.bos_token_id is not None:
                    ids = [tok.bos_token_id, *ids]
            rows.append(ids)
        return rows

    def observation(self, first: str, actions: list[str], observations: list[str], observation: str,
                    closed: bool = True) -> list[int]:
        """The ids of ``observation``, appended right after the model's last turn.

        ``first`` is the episode's first observation, ``actions`` its turns so far (the last one just ended) and
        ``observations`` the observations between them. With a chat template a turn cut before its EOS
        (``closed=False``) gets the EOS as the first observation id.
        """
        tok = self.tokenizer
        if not self.use_chat_template:
            return list(tok(observation, add_special_tokens=False)["input_ids"])
        messages = [{"role": "user", "content": first}]
        for i, action in enumerate(actions):
            messages.append({"role": "assistant", "content": action})
            if i < len(actions) - 1:
                messages.append({"role": "user", "content": observations[i]})
        before = self._template(messages, add_generation_prompt=False)
        after = self._template([*messages, {"role": "user", "content": observation}], add_generation_prompt=True)
        turn_end = self._template(messages[:-1], add_generation_prompt=True) + actions[-1] + tok.eos_token
        if not (after.startswith(before) and before.startswith(turn_end)):
            raise ValueError(f"the chat template of {type(tok).__name__} does not render a conversation as a "
                             "prefix of its continuation; multi-turn episodes need one that does")
        ids = list(tok(after[len(turn_end):], add_special_tokens=False)["input_ids"])
        return ids if closed else [tok.eos_token_id, *ids]
