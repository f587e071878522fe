"""The prompt sampler: seeded epochs, exact resume, no prompt twice in a batch, and a warning when
the data has fewer prompts than a step needs."""

from __future__ import annotations

import json

import pytest

from edgerl.data.prompts import DataError, PromptSampler


def quiet(n, b, seed=0, shuffle=True):
    return PromptSampler(n, b, seed, shuffle, log=None)


def test_sampler_deterministic_epochs_and_resume():
    a, b = quiet(10, 4, seed=7), quiet(10, 4, seed=7)
    seq_a = [a.next_batch() for _ in range(10)]
    assert seq_a == [b.next_batch() for _ in range(10)]
    assert seq_a != [quiet(10, 4, seed=8).next_batch() for _ in range(10)]
    flat = [i for batch in seq_a for i in batch]
    assert all(len(batch) == 4 for batch in seq_a)
    epochs = [flat[k:k + 10] for k in range(0, 40, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # every prompt once per epoch
    assert len({tuple(e) for e in epochs}) > 1                 # reshuffled each epoch
    # resume after 3 batches (mid-epoch) continues exactly
    c = quiet(10, 4, seed=7)
    for _ in range(3):
        c.next_batch()
    state = json.loads(json.dumps(c.state_dict()))  # survives a JSON checkpoint
    d = quiet(10, 4, seed=7)
    d.load_state_dict(state)
    assert [d.next_batch() for _ in range(7)] == seq_a[3:]


def test_sampler_without_shuffle_and_mismatch():
    s = quiet(5, 2, seed=0, shuffle=False)
    assert [s.next_batch() for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]
    with pytest.raises(DataError, match="n_prompts=5 but this run has 6"):
        quiet(6, 2, seed=0, shuffle=False).load_state_dict(s.state_dict())
    with pytest.raises(DataError):
        quiet(0, 2)


@pytest.mark.parametrize("n, b", [(5, 4), (10, 4), (7, 7), (7, 6), (13, 5), (3, 2), (100, 64)])
def test_no_prompt_twice_in_a_batch_and_once_per_epoch(n, b):
    """Batches that span two epochs used to repeat a prompt when the new epoch started with one the
    batch already held."""
    for seed in range(30):
        s = quiet(n, b, seed)
        batches = [s.next_batch() for _ in range(3 * n)]
        assert all(len(set(batch)) == b for batch in batches), (seed, batches)
        flat = [i for batch in batches for i in batch]
        for k in range(0, len(flat) - n + 1, n):
            assert sorted(flat[k:k + n]) == list(range(n)), (seed, k)


def test_resume_across_epoch_boundaries_is_exact():
    straight = quiet(7, 5, seed=3)
    want = [straight.next_batch() for _ in range(20)]
    for k in range(1, 20):
        s = quiet(7, 5, seed=3)
        for _ in range(k):
            s.next_batch()
        r = quiet(7, 5, seed=3)
        r.load_state_dict(json.loads(json.dumps(s.state_dict())))
        assert [r.next_batch() for _ in range(20 - k)] == want[k:], k


def test_state_without_carry_still_loads():
    """Checkpoints written before epochs were reordered have no 'carry': the plain order resumes."""
    s = quiet(10, 4, seed=1)
    state = s.state_dict()
    del state["carry"]
    s.load_state_dict(state)
    assert sorted(s.next_batch() + s.next_batch() + s.next_batch()[:2]) == list(range(10))


def test_more_prompts_per_step_than_prompts_warns_once():
    lines: list[str] = []
    s = PromptSampler(3, 8, seed=0, log=lines.append)
    batches = [s.next_batch() for _ in range(4)]
    assert lines == ["data: train.prompts_per_step=8 but the data has 3 prompt(s), so every step holds some "
                     "prompts more than once; set train.prompts_per_step=3 or less for distinct prompts "
                     "(raise rollout.n_samples to keep the batch size)"]
    flat = [i for batch in batches for i in batch]
    assert all(sorted(flat[k:k + 3]) == [0, 1, 2] for k in range(0, 30, 3))  # still once per epoch
    quiet_lines: list[str] = []
    PromptSampler(3, 3, seed=0, log=quiet_lines.append)
    assert quiet_lines == []


def test_the_warning_reaches_stdout_by_default(capsys):
    PromptSampler(2, 4)
    assert "train.prompts_per_step=4 but the data has 2 prompt(s)" in capsys.readouterr().out
