"""Custom reward functions for the training tests (verl's signature)."""


def vowel_share(data_source, solution_str, ground_truth, extra_info=None):
    """Share of letters that are vowels: random text scores ~0.3 and varies, so GRPO has a signal."""
    letters = [c for c in solution_str.lower() if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c in "aeiou" for c in letters) / len(letters)


def nan_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "note": float("nan")}


def broken(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("expected_field")


def share_of_a(data_source, solution_str, ground_truth, extra_info=None):
    """Share of characters that are the letter 'a' (about 1/45 at random)."""
    return solution_str.count("a") / max(1, len(solution_str))
