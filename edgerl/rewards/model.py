"""A learned reward: an HF sequence-classification model with one label, scored on (prompt, response)."""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from edgerl.rewards.rules import RewardError

Chat = list[dict[str, str]]


class RewardModel:
    """Scores responses with `AutoModelForSequenceClassification` (num_labels=1): the logit of the
    single label at the last token of each joined (prompt, response) text.

    The pair is joined with the tokenizer's chat template when it has one (the prompt as the user
    turn, or the given chat list, then the response as the assistant turn), else by concatenation.
    `score` returns one float per pair, computed in batches of `batch_size` with right padding.
    """

    def __init__(self, path: str, device: Union[str, torch.device] = "cpu",
                 dtype: torch.dtype = torch.float32, batch_size: int = 8,
                 max_length: int | None = None, trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code)
        except (Exception, SystemExit) as e:  # remote code may exit; a Ctrl-C stays an interrupt
            raise RewardError(f"cannot load the reward model {path!r}: {type(e).__name__}: {e}") from e
        if self.model.config.num_labels != 1:
            raise RewardError(f"reward model {path!r} has num_labels={self.model.config.num_labels}; a "
                              "reward model needs exactly one output (num_labels=1)")
        if batch_size < 1:
            raise RewardError(f"reward model batch_size must be at least 1, got {batch_size}")
        self.model.to(device).eval()
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.path = path

    def join(self, prompt: Union[str, Chat], response: str) -> tuple[str, bool]:
        """(text, add_special_tokens) for one pair: templated text already holds its special tokens."""
        if self.tokenizer.chat_template:
            messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            messages.append({"role": "assistant", "content": response})
            return self.tokenizer.apply_chat_template(messages, tokenize=False), False
        if isinstance(prompt, list):
            raise RewardError(f"reward model {self.path!r}: its tokenizer has no chat template, so a chat-"
                              "list prompt cannot be joined; pass the prompt as text")
        return prompt + response, True

    def encode(self, prompts: Sequence[Union[str, Chat]], responses: Sequence[str]) -> list[list[int]]:
        if len(prompts) != len(responses):
            raise RewardError(f"reward model: {len(prompts)} prompts but {len(responses)} responses")
        ids = []
        for p, r in zip(prompts, responses):
            text, special = self.join(p, r)
            seq = self.tokenizer(text, add_special_tokens=special).input_ids
            if self.max_length is not None and len(seq) > self.max_length:
                seq = seq[-self.max_length:]  # keep the end: the score is read at the last token
            ids.append(seq)
        return ids

    @torch.no_grad()
    def score(self, prompts: Sequence[Union[str, Chat]], responses: Sequence[str]) -> list[float]:
        """One reward per (prompt, response) pair."""
        all_ids = self.encode(prompts, responses)
        out: list[float] = []
        for start in range(0, len(all_ids), self.batch_size):
            out.extend(self._score_ids(all_ids[start:start + self.batch_size]))
        return out

    def _score_ids(self, batch: list[list[int]]) -> list[float]:
        # HF's sequence-classification heads read the logit at the rightmost token that is not
        # config.pad_token_id. If a text ends with the pad token (SmolLM2's pad is <|im_end|>, which
        # chat templates emit), that rule would read the wrong position; so pad with an id that
        # no sequence ends with, and point the config at it for this call.
        lasts = {seq[-1] for seq in batch if seq}
        if any(not seq for seq in batch):
            raise RewardError("reward model: a (prompt, response) pair tokenized to nothing")
        pad = self.tokenizer.pad_token_id
        if pad is None or pad in lasts:
            pad = next(i for i in range(len(lasts) + 1) if i not in lasts)
        width = max(len(seq) for seq in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, seq in enumerate(batch):
            input_ids[i, :len(seq)] = torch.tensor(seq)
            attention[i, :len(seq)] = 1
        cfg: Any = self.model.config.get_text_config()
        saved = cfg.pad_token_id
        cfg.pad_token_id = pad
        try:
            logits = self.model(input_ids=input_ids.to(self.device),
                                attention_mask=attention.to(self.device)).logits
        finally:
            cfg.pad_token_id = saved
        return logits[:, 0].float().cpu().tolist()
