"""The errors a user can cause by what they type or point at, in one module that imports nothing.

Each says what is wrong and how to fix it; the CLI prints it as one line and exits with status 2
(`USER_ERRORS`). Modules raise them from here, so that no module imports another only to reach
an exception class.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, mistyped or inconsistent; the message says how to fix it."""


class SpecError(ValueError):
    """A GPU description (--gpu-spec, a capability) edgerl cannot use; the message says why."""


class ProfileError(ValueError):
    """Unknown profile name or a malformed profile file."""


class ModelSpecError(ValueError):
    """A model name or folder edgerl cannot describe; the message lists what it can."""


class PlanError(ValueError):
    """No setting fits, or an override asks for something this device cannot do."""


class DataError(ValueError):
    """Training data that cannot be used; the message names the file, row and field."""


class RewardError(ValueError):
    """A reward function or reward model that cannot be loaded or failed on a sample."""


class ToolError(ValueError):
    """A tool or environment (rollout.tools, rollout.environment) that cannot be loaded or that broke its
    protocol; a tool that merely failed on a call answers the model with an error instead."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unreadable; the message names the folder."""


class RunDirError(RuntimeError):
    """A run folder that cannot be used as asked (it holds another run, is a file, is read-only)."""


class ModelError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says what to do."""


class EmbeddedModelError(RuntimeError):
    """The embedded model's package is missing or cannot be converted."""


class OptimizerError(RuntimeError):
    """The optimizer the plan asks for cannot be built here; the message says what to do."""


class ExportError(RuntimeError):
    """An export that cannot be written or pushed where asked; the message says what was kept."""


class TrainingError(RuntimeError):
    """Training cannot continue; the message says why and what to change."""


class PlatformError(RuntimeError):
    """This operating system cannot do what was asked (training on native Windows); the message says where."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, SpecError, ProfileError, ModelSpecError, PlanError, DataError, RewardError, ToolError, CheckpointError,
    RunDirError, ModelError, EmbeddedModelError, OptimizerError, TrainingError, PlatformError, ExportError)
