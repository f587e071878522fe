"""The typer app, its consoles and the shared options; commands register on `app` from their modules."""

from __future__ import annotations

import functools
from typing import Callable

import typer
from rich.console import Console
from rich.markup import escape

from edgerl.core.errors import USER_ERRORS, ModelError, TrainingError
from edgerl.train.ranks import from_env

app = typer.Typer(name="edgerl", no_args_is_help=True, add_completion=False,
                  help="Hardware-adaptive RL fine-tuning (PPO, GRPO) of LLMs on the GPUs people actually have.")
RANK = from_env()
console = Console(quiet=not RANK.main)  # under torchrun, rank 0 alone talks to the user
err = Console(stderr=True)


def friendly(fn: Callable) -> Callable:
    """Errors caused by what the user typed or pointed at (edgerl.core.errors.USER_ERRORS): one red line,
    exit status 2, no traceback. The message is printed as text: a `[section]` in it is not markup."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            # every rank meets the same bad input; a failure while loading or training can be one rank's own
            if RANK.main or isinstance(e, (TrainingError, ModelError)):
                who = f"rank {RANK.rank}: " if RANK.world > 1 else ""
                err.print(f"[bold red]{who}error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
    return wrapper


GpuOpt = typer.Option(None, "--gpu", "--profile", help="plan for this GPU profile (see `edgerl profiles`)")
SpecOpt = typer.Option(None, "--gpu-spec", help='a GPU without a profile: cc=6.1,memory=24GiB,name="Quadro P6000"')
ConfigOpt = typer.Option(None, "--config", "-c", help="run config TOML")
SetOpt = typer.Option(None, "--set", "-s", help="override one config key: --set train.lr=1e-6 (repeatable)")
