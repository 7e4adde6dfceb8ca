"""Every ZeRO knob, defined once: ``ShardingConfig``'s fields (name, type, default, docstring).

Everything else that takes a knob derives from those fields, so a new field reaches all of
them: ``group_sharded_parallel``'s keyword arguments fill one (``merge_arguments``),
``load_config`` reads one from a file, ``Strategy`` inherits them, ``parallelize(config=)`` and
the Lightning and Fabric strategies pass one on, and the ranks compare every field before
anything is built (``agreement_fields``). The level is parsed in one place (``parse_level``:
names and stage numbers) and has one default (``DEFAULT_LEVEL``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from torch import nn

from .mixed_precision import as_policy

#: the levels, in stage order (PaddlePaddle's names: each means exactly what it says)
LEVELS = ("os", "os_g", "p_g_os")
#: the level of every entry point that has a default (``parallelize``, ``Strategy``, the
#: Lightning and Fabric strategies); ``group_sharded_parallel`` keeps Paddle's signature,
#: where the level is given (None reads ``$ZEROKIT_LEVEL``)
DEFAULT_LEVEL = "p_g_os"
#: stage numbers (DeepSpeed's names), as numbers or strings, to the level
LEVEL_ALIASES = {1: "os", 2: "os_g", 3: "p_g_os", "1": "os", "2": "os_g", "3": "p_g_os"}
LEVEL_ENV = "ZEROKIT_LEVEL"
DEBUG_AGREEMENT_ENV = "ZEROKIT_DEBUG_AGREEMENT"
#: a field holding Python objects (module classes or instances), which no file can spell
_CODE_ONLY = {"in_files": False}


def parse_level(level: str | int) -> str:
    """The one level parser: ``'os'``/``'os_g'``/``'p_g_os'`` or a stage number 1/2/3 (also
    ``'1'``...), to the level's name.

    >>> parse_level(3), parse_level("os_g"), parse_level(" 2 ")
    ('p_g_os', 'os_g', 'os_g')
    """
    name = (
        None
        if isinstance(level, bool)
        else LEVEL_ALIASES.get(level.strip() if isinstance(level, str) else level, level)
    )  # True == 1 in a dict: a bool is no stage number
    if name not in LEVELS:
        raise ValueError(
            f"unknown level {level!r}; valid levels: 'os' (stage 1), 'os_g' (stage 2), "
            "'p_g_os' (stage 3), or the stage numbers 1, 2, 3"
        )
    return name


def resolve_level(level: str | int | None) -> str:
    """``parse_level(level)``, or for None the level ``$ZEROKIT_LEVEL`` names.

    >>> resolve_level(3), resolve_level("os_g")
    ('p_g_os', 'os_g')
    """
    if level is None:
        level = os.environ.get(LEVEL_ENV)
        if level is None:
            raise ValueError(
                f"no level given and ${LEVEL_ENV} is not set: pass level='os' | 'os_g' | "
                "'p_g_os' (or a stage number 1 | 2 | 3), or set it in the environment"
            )
    return parse_level(level)


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """Every knob of ``group_sharded_parallel`` beyond the model, the optimizer, the scaler and
    the groups, in one place: the single definition of each. ``group_sharded_parallel``'s
    keyword arguments of the same names (Paddle's signature) fill one of these; ``load_config``
    reads one from a file; ``Strategy`` inherits these fields; ``parallelize(config=)`` and the
    Lightning and Fabric strategies take one (or its fields as keyword arguments)."""

    level: str | int | None = None
    """``'os'``, ``'os_g'``, ``'p_g_os'`` (or 1, 2, 3, held as the name); None: the ``level``
    argument, else ``$ZEROKIT_LEVEL`` (``parallelize`` and the strategies: ``DEFAULT_LEVEL``)."""
    mixed_precision: Any = None
    """A ``zerokit.MixedPrecision`` policy, or its name ``"bf16"`` / ``"fp16"`` (held as the
    policy); None: fp32."""
    offload: bool = False
    """Keep the fp32 master shards and optimizer state in CPU memory and step there (a no-op
    when the model is already on the CPU)."""
    sync_buffers: bool = False
    """Broadcast rank 0's buffers to every rank before each forward."""
    buffer_max_size: int = 2**23
    """Most elements per flat bucket (one collective per bucket)."""
    segment_size: int = 2**20
    """A module whose own parameters reach this many elements becomes a unit of its own."""
    sync_comm: bool = False
    """Finish each collective at once instead of overlapping it with compute (the least
    memory in backward, paid for in time)."""
    exclude_layer: tuple = field(default=(), metadata=_CODE_ONLY)
    """Level 'p_g_os': modules (or module classes) kept whole on every rank."""
    step_in_backward: bool = False
    """Levels 'os_g', 'p_g_os': step each unit as soon as its gradients are reduced, inside
    backward (no global-norm clipping or loss scaler then)."""
    wrap: tuple[type[nn.Module], ...] = field(default=(), metadata=_CODE_ONLY)
    """Module classes whose instances become units: a unit's gradients are reduced together
    as soon as its backward is done, and at level 'p_g_os' its parameters are gathered and
    freed together. Empty: the default policy — children of ``nn.ModuleList``/
    ``nn.Sequential``. Either way, modules whose own parameters reach ``segment_size``
    elements are units too."""
    elementwise_optimizer: bool = False
    """Declare that an optimizer zerokit does not know (not SGD, Adam, AdamW, Adagrad,
    Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop or Rprop) updates each element from that
    element's gradient and state alone, so stepping shards is exact. Unknown optimizers are
    refused otherwise."""
    whole_parameter_optimizer: bool = False
    """Declare that an optimizer zerokit does not know reads whole parameters in its update
    (as Muon and Adafactor, which zerokit knows, do): each parameter it steps is then owned
    whole by one rank, which steps it on the averaged gradient (the owner layout). A class can
    say so itself with the attribute ``zerokit_whole_parameter = True``."""
    whole_grads: bool = False
    """Level 'os': all-reduce whole gradients, so every rank's ``param.grad`` is the whole
    averaged gradient (for a loop that reads ``.grad`` values), at 3Ψ(N-1)/N bytes a step.
    False (the default): the ZeRO paper's stage 1, DDP's 2Ψ(N-1)/N — each rank reduce-scatters
    into its shard and ``param.grad`` is a placeholder, as at 'os_g' (torch's clips stay exact).
    Other levels refuse True."""
    shard_optimizer_over_replicas: bool = False
    """Hybrid sharding (a ``replica_group`` of R ranks beside the shard group of S): shard the
    optimizer state over the replicas too, so each rank holds 1/(S·R) of it (the optimizer
    state of 1/R of its shard) instead of 1/S. The gradient shard is reduce-scattered across
    replicas instead of all-reduced, each replica steps its sub-shard, and the updated
    sub-shards are all-gathered across replicas: the same bytes between replicas (reduce-
    scatter + all-gather = all-reduce). Every level; not with ``whole_grads=True``. Without
    hybrid sharding (no replica group, or one of size 1) it changes nothing: the state is
    sharded over every rank already."""
    debug_agreement: bool = False
    """Debug mode for level 'p_g_os': before every gather the ranks check (one blocking
    all-reduce and a host sync) that they gather the same unit, so a module that runs on some
    ranks only is named at once. Off by default: it costs a collective per gather. Without it
    a rank that gathers alone is named by the bounded wait (``CollectiveTimeout`` after
    ``$ZEROKIT_COLLECTIVE_TIMEOUT``) and a different unit order by the one check after each
    forward. ``$ZEROKIT_DEBUG_AGREEMENT=1`` turns it on without changing code."""

    # Note: which knobs were given is kept beside the fields, so that a value equal to the
    # default still counts when it is given twice (``offload=False`` against a config's
    # ``offload=True`` is refused, not dropped); None is "not given". ``__new__`` sees the
    # constructor's keywords, the generated ``__init__`` cannot tell them from defaults.
    def __new__(cls, **given):
        self = super().__new__(cls)
        object.__setattr__(self, "_given", frozenset(k for k, v in given.items() if v is not None))
        return self

    def __post_init__(self):
        for name in ("exclude_layer", "wrap"):  # None or a list: held as a tuple
            value = getattr(self, name)
            if value is None or isinstance(value, list):
                object.__setattr__(self, name, tuple(value or ()))
        check_knobs(self)
        if self.level is not None:  # held as its name: 2 and "os_g" are one config
            object.__setattr__(self, "level", parse_level(self.level))
        object.__setattr__(self, "mixed_precision", as_policy(self.mixed_precision))


_BOOLS = ("offload", "sync_buffers", "sync_comm", "step_in_backward", "elementwise_optimizer",
          "whole_parameter_optimizer", "debug_agreement")  # fmt: skip
_SIZES = ("buffer_max_size", "segment_size")


def check_knobs(config: ShardingConfig) -> None:
    """Every knob of the right type (a wrong one is named with what it takes), before
    anything is built: ``offload="yes"`` is a mistake, not True."""
    for name in _BOOLS:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    for name in _SIZES:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TypeError(f"{name} must be a positive int (elements), got {value!r}")
    level = config.level
    if level is not None and (isinstance(level, bool) or not isinstance(level, (str, int))):
        raise TypeError(
            f"level must be 'os', 'os_g', 'p_g_os', a stage number 1, 2, 3, or None; got {level!r}"
        )
    _check_modules("exclude_layer", config.exclude_layer, instances=True)
    _check_modules("wrap", config.wrap, instances=False)


def _check_modules(name: str, items, *, instances: bool) -> None:
    what = "nn.Module instances or classes" if instances else "nn.Module classes"
    if isinstance(items, (nn.Module, type, str)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{name} must be a list or tuple of {what}, got {items!r}")
    for item in items:
        is_class = isinstance(item, type) and issubclass(item, nn.Module)
        if not (is_class or (instances and isinstance(item, nn.Module))):
            raise TypeError(f"{name} must hold {what}, got {item!r}")


#: the knobs ``group_sharded_parallel`` also takes as arguments (Paddle's signature)
ARGUMENT_KNOBS = (
    "level", "mixed_precision", "offload", "sync_buffers", "buffer_max_size", "segment_size",
    "sync_comm", "exclude_layer", "step_in_backward",
)  # fmt: skip


def merge_arguments(
    config: ShardingConfig | None, *, source: str = "an argument", **arguments
) -> ShardingConfig:
    """``config`` with the knobs given as arguments (``group_sharded_parallel``'s, a strategy's
    keyword arguments) filled in; ``source`` names where they come from. An argument of None
    is not given. A knob given both ways is compared, whatever its value (the default too):
    the same value passes, another is refused naming both. A name that is no field of
    ``ShardingConfig`` is refused.

    >>> merge_arguments(ShardingConfig(offload=True), level=2).level
    'os_g'
    """
    config = config or ShardingConfig()
    unknown = sorted(set(arguments) - set(knob_names()))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; the knobs are {list(knob_names())}")
    changes = {}
    for name, value in arguments.items():
        if value is None:
            continue
        value, held = _normal(name, value), getattr(config, name)
        if name in given_knobs(config) and held != value:
            raise ValueError(
                f"{name} is given twice, as {source} ({value!r}) and in config ({held!r}): "
                "give it once"
            )
        changes[name] = value
    return with_knobs(config, **changes)


def given_knobs(config: ShardingConfig) -> frozenset[str]:
    """The names of the knobs ``config`` was given (not None), rather than defaulted to."""
    return getattr(config, "_given", frozenset())


def with_knobs(config: ShardingConfig, **changes) -> ShardingConfig:
    """``dataclasses.replace(config, **changes)``, remembering the knobs given before and
    these as given (``replace`` passes every field on, so the copy would count all)."""
    out = replace(config, **changes)
    given = given_knobs(config) | {k for k, v in changes.items() if v is not None}
    object.__setattr__(out, "_given", given)
    return out


def _normal(name: str, value):
    """A knob's value as ``ShardingConfig`` holds it, to compare with what a config holds."""
    if name in ("exclude_layer", "wrap") and (value is None or isinstance(value, list)):
        return tuple(value or ())
    if name == "mixed_precision":
        return as_policy(value)
    if name == "level" and isinstance(value, (str, int)) and not isinstance(value, bool):
        return parse_level(value)
    return value


def knob_names(*, in_files: bool = False) -> tuple[str, ...]:
    """The names of ``ShardingConfig``'s fields, in order; ``in_files``: those a config file
    can spell (not the ones holding module classes or instances)."""
    return tuple(
        f.name for f in fields(ShardingConfig) if not in_files or f.metadata.get("in_files", True)
    )


def knobs_of(config: ShardingConfig) -> dict[str, Any]:
    """Every knob of ``config`` (a ``Strategy`` too) by name, as a ``ShardingConfig``'s fields."""
    return {name: getattr(config, name) for name in knob_names()}


def agreement_fields(config: ShardingConfig, model: nn.Module) -> dict[str, Any]:
    """Every knob of ``config``, by its name, as the ranks compare it before anything is
    built: a rank given another value is named with the knob. Modules are compared by their
    names in ``model`` (or their class's), never by identity."""
    names = {id(m): n for n, m in model.named_modules()}

    def describe(items) -> list[str]:
        return [
            item.__qualname__ if isinstance(item, type) else names.get(id(item), "<not in model>")
            for item in items
        ]

    out: dict[str, Any] = knobs_of(config)
    out["exclude_layer"], out["wrap"] = describe(config.exclude_layer), describe(config.wrap)
    out["mixed_precision"] = repr(config.mixed_precision)
    return out


def debug_agreement(config: ShardingConfig) -> bool:
    """``config.debug_agreement``, or ``$ZEROKIT_DEBUG_AGREEMENT`` set to 1."""
    return config.debug_agreement or os.environ.get(DEBUG_AGREEMENT_ENV, "").strip() == "1"


def read_table(path: str | os.PathLike, what: str, *, otherwise_json: bool) -> dict[str, Any]:
    """The table of a ``.toml``, ``.json`` or ``.yaml``/``.yml`` file (``load_config`` and
    ``Strategy.load``). ``otherwise_json``: another ending is read as JSON, else refused."""
    import json

    path = str(path)
    ext = os.path.splitext(path)[1].lower()
    text = Path(path).read_text()
    if ext == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError(f"{path}: TOML needs Python 3.11 or newer; use JSON") from None
        data = tomllib.loads(text)
    elif ext in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ImportError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the {what} "
                "as TOML or JSON"
            ) from None
        data = yaml.safe_load(text)
    elif ext == ".json" or otherwise_json:
        data = json.loads(text)
    else:
        raise ValueError(f"{path}: a {what} file ends in .toml, .json, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {what} file holds a table of fields, got {data!r}")
    return data


def load_config(path: str | os.PathLike) -> ShardingConfig:
    """A ``ShardingConfig`` from a small TOML, JSON or YAML file whose keys are its fields
    (``level`` as a name or a stage number, ``mixed_precision`` as ``"bf16"``, ``"fp16"`` or
    none), all but ``exclude_layer`` and ``wrap``, which hold module classes: pass those in
    code. Use it as
    ``group_sharded_parallel(model, opt, config=zerokit.load_config("zerokit.toml"))``.
    """
    raw = read_table(path, "config", otherwise_json=True)
    valid = knob_names(in_files=True)
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; valid keys: {', '.join(valid)}")
    if not isinstance(raw.get("mixed_precision"), (str, type(None))):
        raise ValueError(f"{path}: mixed_precision must be 'bf16' or 'fp16'")
    try:
        return ShardingConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
