"""Episodes of several turns: tools the model calls, environments that answer it (docs/agents.md).

    calls.py     the chat template's tool-call format: detect it, parse a turn's calls, render what
                 goes back (tool results, observations) as the tokens that follow the model's turn
    toolbox.py   the run's tools and environment, served by worker processes (edgerl.rewards.contain)
    host.py      what runs inside such a worker: loads the tools, confines the process (guard.py),
                 calls a tool or steps an environment with a time limit, turns its result into text
    builtin.py   the built-in tools: `calculator` and `python`
    episode.py   one episode's conversation: its tokens, whose they are, its turns and rewards

Tools are one kind of environment: the episode hands the model's turn to the tools (their calls) or to
the environment (`step`), and what comes back is appended as context the model does not train on.
"""
