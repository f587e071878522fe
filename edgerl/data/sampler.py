"""The order in which training prompts are drawn: seeded, resumable, every prompt once per epoch,
no prompt twice in one batch when the data has enough prompts, and a warning when it has not."""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

from edgerl.core.errors import DataError


class PromptSampler:
    """Seeded, resumable prompt order: each epoch is a permutation of range(n_prompts) (the
    identity when shuffle is False); batches run across epoch boundaries, so every prompt is used
    once per epoch and none is skipped. `state_dict()` after k batches, loaded into a fresh sampler,
    continues with batch k+1 exactly.

    A batch that spans two epochs would hold a prompt twice when the new epoch's order starts with
    one the batch already has from the old epoch's end; those prompts are moved just past this
    batch's share of the new epoch (they still come once in it). So with batch_size <= n_prompts
    no batch repeats a prompt.

    With batch_size > n_prompts every batch must repeat some. That is not an error: a tiny set is
    a fair smoke test or overfitting check, and a repeated prompt is still scored right (each copy
    is its own group of rollout.n_samples responses, groups being contiguous rows); it only costs
    variety. `log` gets one line saying so, when the sampler is made.
    """

    def __init__(self, n_prompts: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 log: Optional[Callable[[str], None]] = print):
        if n_prompts < 1:
            raise DataError("no prompts to sample from")
        if batch_size < 1:
            raise DataError(f"prompt batch size must be at least 1, got {batch_size}")
        self.n_prompts, self.batch_size, self.seed, self.shuffle = n_prompts, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0
        # (prompts of the previous epoch in the batch that crossed into this one, that batch's
        # share of this epoch): what reorders this epoch; kept in the state to resume exactly
        self._carry: Optional[tuple[list[int], int]] = None
        self._order = self._permutation(0)
        if batch_size > n_prompts and log is not None:
            log(f"data: train.prompts_per_step={batch_size} but the data has {n_prompts} prompt(s), so every "
                f"step holds some prompts more than once; set train.prompts_per_step={n_prompts} or less for "
                "distinct prompts (raise rollout.n_samples to keep the batch size)")

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n_prompts))
        if self.shuffle:
            random.Random(f"edgerl-sampler/{self.seed}/{epoch}").shuffle(order)
        if self._carry is None:
            return order
        taken, share = set(self._carry[0]), self._carry[1]
        head: list[int] = []
        rest: list[int] = []
        for i in order:
            (head if len(head) < share and i not in taken else rest).append(i)
        return head + rest

    def next_batch(self) -> list[int]:
        """The next `batch_size` prompt indices."""
        out: list[int] = []
        while len(out) < self.batch_size:
            if self.pos == self.n_prompts:
                self.epoch, self.pos = self.epoch + 1, 0
                crossing = 0 < len(out) and self.batch_size <= self.n_prompts
                self._carry = (list(out), self.batch_size - len(out)) if crossing else None
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - len(out), self.n_prompts - self.pos)
            out.extend(self._order[self.pos:self.pos + take])
            self.pos += take
        return out

    def state_dict(self) -> dict[str, Any]:
        carry = None if self._carry is None else [list(self._carry[0]), self._carry[1]]
        return {"n_prompts": self.n_prompts, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "epoch": self.epoch, "pos": self.pos, "carry": carry}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("n_prompts", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise DataError(f"cannot resume the prompt order: the checkpoint has {key}={state.get(key)!r} "
                                f"but this run has {getattr(self, key)!r}; the data or seed changed since "
                                "the checkpoint. Resume with the run's own data and train.seed (its config.toml), "
                                "or start a new run (--out NEW_FOLDER) on the new data")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        carry = state.get("carry")  # absent in checkpoints from before epochs were reordered
        self._carry = None if carry is None else ([int(i) for i in carry[0]], int(carry[1]))
        self._order = self._permutation(self.epoch)
