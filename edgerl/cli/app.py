"""The typer app, its consoles and the shared options; commands register on `app` from their modules."""

from __future__ import annotations

import errno
import functools
import inspect
import os
import signal
import sys
from pathlib import Path
from typing import Callable

import typer
from rich.console import Console
from rich.markup import escape

from edgerl.core.errors import USER_ERRORS, ConfigError, ModelError, TrainingError
from edgerl.core.files import check_path, shown
from edgerl.rewards.contain import Interrupted
from edgerl.train.ranks import Rank, from_env, leave_together

app = typer.Typer(name="edgerl", no_args_is_help=True, add_completion=False,
                  help="Hardware-adaptive RL fine-tuning (PPO, GRPO) of LLMs on the GPUs people actually have.")
try:
    RANK = from_env()
except ConfigError:   # garbage in RANK/WORLD_SIZE: `edgerl train` says so (ranks.from_env); the rest ignore them
    RANK = Rank()
console = Console(quiet=not RANK.main)  # under torchrun, rank 0 alone talks to the user
err = Console(stderr=True)


class Stopped(BaseException):
    """SIGTERM before the training loop took over the signals (it saves a checkpoint and stops). A
    BaseException, as KeyboardInterrupt is: no `except Exception` on the way may swallow it."""


def _on_term(signum, _frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def _say(message: str) -> None:
    who = f"rank {RANK.rank}: " if RANK.world > 1 else ""
    err.print(f"[bold red]{who}error:[/] {escape(shown(message))}", highlight=False, soft_wrap=True)


def _output_failed(e: OSError) -> bool:
    """True when `e` came from writing the command's output (`> /dev/full`, a closed pipe): raised inside
    rich, click or typer, which print for edgerl. Then the output is pointed at /dev/null, so that the
    interpreter's last flush does not fail again with a traceback."""
    tb, printing = e.__traceback__, False
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        printing = printing or any(f"/{pkg}/" in name for pkg in ("rich", "click", "typer"))
        tb = tb.tb_next
    if printing:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
    return printing


def _os_error(e: OSError) -> str:
    """One line for an OSError nothing nearer to its cause turned into a user error."""
    where = " ".join(shown(str(f)) for f in (e.filename, e.filename2) if f)
    what = e.strerror or str(e)
    fix = {errno.ENOSPC: "free disk space, then run the command again",
           errno.EACCES: "check the permissions", errno.EROFS: "choose a folder on a writable disk",
           errno.ENAMETOOLONG: "choose a shorter name", errno.ELOOP: "fix or remove the symbolic link"}
    return f"{what}{': ' + where if where else ''}" + (f"; {fix[e.errno]}" if e.errno in fix else "")


def _labels(fn: Callable) -> dict[str, str]:
    """Each parameter of a command as the user types it: '--out' for an option, 'RUN_DIR' for an argument."""
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        decls = [d for d in getattr(p.default, "param_decls", None) or () if d.startswith("--")]
        out[name] = max(decls, key=len) if decls else name.upper()
    return out


def _check_path_args(kwargs: dict, labels: dict[str, str]) -> None:
    """Every path argument of a command, through one validator (core.files.check_path), before the command
    runs: a name too long for any file system, bytes that are not UTF-8, a loop of symbolic links."""
    for name, value in kwargs.items():
        for v in (value if isinstance(value, list) else [value]):
            if isinstance(v, Path):
                check_path(v, labels.get(name, name))


def friendly(fn: Callable) -> Callable:
    """Errors caused by what the user typed or pointed at (edgerl.core.errors.USER_ERRORS): one red line,
    exit status 2, no traceback. The message is printed as text: a `[section]` in it is not markup.

    The same for what reaches here from the system rather than from edgerl's checks: an OSError (a full
    disk, a name too long, a file that vanished; the output itself unwritable, `> /dev/full`), input
    nested too deeply to read (RecursionError) and text that cannot be encoded (UnicodeError). SIGTERM
    before training starts (while the model loads, say) ends the command with a line and status 130,
    as Ctrl-C does; once the loop runs, it saves a checkpoint first (edgerl.train.trainer)."""
    labels = _labels(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            previous = signal.signal(signal.SIGTERM, _on_term)
        except ValueError:   # not the main thread
            previous = None
        try:
            _check_path_args(kwargs, labels)
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            # every rank meets the same bad input; a failure while loading or training can be one rank's own
            if RANK.main or isinstance(e, (TrainingError, ModelError)):
                _say(str(e))
            leave_together()   # under torchrun, when every rank stopped here: after rank 0 said why
            raise typer.Exit(2) from None
        except (Stopped, KeyboardInterrupt, Interrupted) as e:
            # Interrupted: the signal stopped user code (a reward file being imported, a reward in `eval`)
            name = str(e) if isinstance(e, Stopped) else e.signal if isinstance(e, Interrupted) else "SIGINT (Ctrl-C)"
            after = ("before training began; nothing was trained: run the same command again to start"
                     if fn.__name__ == "train" else "; run the command again")
            err.print(f"[yellow]stopped by {name}{' ' if after[0] != ';' else ''}{after}[/]", highlight=False,
                      soft_wrap=True)
            raise typer.Exit(130) from None
        except OSError as e:
            if _output_failed(e):
                _say(f"cannot write the output: {e.strerror or e}; nothing else failed, but what was printed "
                     "is incomplete")
            else:
                _say(_os_error(e))
            raise typer.Exit(2) from None
        except RecursionError:
            _say("the input is nested too deeply to be read (Python's recursion limit was reached); flatten "
                 "its nesting")
            raise typer.Exit(2) from None
        except UnicodeError as e:
            if isinstance(e, UnicodeEncodeError):   # a lone surrogate, as a JSON "\\ud800" escape makes one
                _say(f"text that cannot be written as UTF-8 ({e.reason}: {shown(e.object[e.start:e.end])}); "
                     "remove that character from the input that holds it")
            else:
                _say(f"input that is not UTF-8 text ({e}); save it as UTF-8")
            raise typer.Exit(2) from None
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    return wrapper


GpuOpt = typer.Option(None, "--gpu", "--profile", help="plan for this GPU profile (see `edgerl profiles`)")
SpecOpt = typer.Option(None, "--gpu-spec", help='a GPU without a profile: cc=6.1,memory=24GiB,name="Quadro P6000"')
ConfigOpt = typer.Option(None, "--config", "-c", help="run config TOML")
SetOpt = typer.Option(None, "--set", "-s", help="override one config key: --set train.lr=1e-6 (repeatable)")
