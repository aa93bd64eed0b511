"""Errors the engine raises on purpose. Everything a user can cause is a subclass of ``DuetError`` so the
front doors (HTTP, gRPC, CLI) can map it to a 4xx / INVALID_ARGUMENT instead of a 500."""


class DuetError(Exception):
    """Base of every error duet raises deliberately."""


class ModelLoadError(DuetError, ValueError):
    """A checkpoint directory is missing a file, has an unsupported architecture or mismatched shapes."""


class InvalidRequestError(DuetError, ValueError):
    """A request the engine refuses: empty prompt, too long, bad sampling parameters, unknown token ids."""


class ConfigError(DuetError, ValueError):
    """A configuration value is out of range or inconsistent."""


class RankLostError(DuetError, RuntimeError):
    """A tensor-parallel rank's collective failed (a rank died or left): the engine cannot step again; its
    worker is replaced (engine/models/tensor_parallel.py)."""


class LoraAdapterError(DuetError, ValueError):
    """A LoRA adapter duet cannot serve or load (engine/lora/): the message names the file and the field or tensor,
    or the limit (max_cpu_loras, max_lora_rank, a pin) that refused it."""


class LoraCapacityError(LoraAdapterError):
    """Every adapter a worker may hold (``max_cpu_loras``) is loaded: unload one first (a resolver's idle adapter is
    unloaded for it: router/lora_adapters.py). HTTP 429 / RESOURCE_EXHAUSTED when nothing can make room."""


class LoraAdaptersBusyError(LoraCapacityError):
    """A request's adapter could be loaded (router/lora_resolver.py) but no loaded adapter can make room now: every one
    the resolver loaded has running requests. HTTP 429 with Retry-After / RESOURCE_EXHAUSTED: retry."""

    retry_after_s = 1


class LoraAdapterNotFoundError(LoraAdapterError):
    """No such adapter: an unknown name (unload), or no directory at the path (load). HTTP 404 / NOT_FOUND."""
