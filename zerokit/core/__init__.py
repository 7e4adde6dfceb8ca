"""The sharding core: flat layout, buckets, collectives, unit groups and their life cycle.

Its face: the names below are what the rest of zerokit may use (``tests/test_import_rules.py``
holds that nothing outside the core imports a module inside it, save the dry run's stand-in
backend, ``core.stand_in``, for the dry-run tools). ``docs/ARCHITECTURE.md`` says what each is
for. The core imports nothing of zerokit but ``zerokit.runtime`` and ``mixed_precision``.
"""

from .agreement import agree_all, alive, gather, meet
from .bucket_layout import BucketLayout
from .build import CoreOptions, LevelRules, build
from .checks import (
    agree_arguments,
    check_dense_gradients,
    check_not_wrapped,
    is_distributed,
    layout_summary,
)
from .collectives import all_reduce_, broadcast_, communication_device
from .compiled import plain_name, unwrap_compiled
from .grad_placeholder import ShardedGradError, is_placeholder
from .group import NotGatheredError
from .module import ShardedModule, broadcast_module_state
from .optimizer import as_optimizer_list, optimizer_params_of
from .optimizer_needs import (
    check_optimizer,
    muon_cost,
    needs_of,
    refuse_whole_on_slices,
    with_whole_numel,
)
from .release import release
from .stand_in import is_stand_in
from .state import ShardState, state_of
from .units import UnitPlan, plan_groups, plan_units
from .whole_shards import whole_shards

__all__ = [  # each one's use: docs/ARCHITECTURE.md, 'The core's face'
    "BucketLayout",
    "CoreOptions",
    "LevelRules",
    "NotGatheredError",
    "ShardState",
    "ShardedGradError",
    "ShardedModule",
    "UnitPlan",
    "agree_all",
    "agree_arguments",
    "alive",
    "all_reduce_",
    "as_optimizer_list",
    "broadcast_",
    "broadcast_module_state",
    "build",
    "check_dense_gradients",
    "check_not_wrapped",
    "check_optimizer",
    "communication_device",
    "gather",
    "is_distributed",
    "is_placeholder",
    "is_stand_in",
    "layout_summary",
    "meet",
    "muon_cost",
    "needs_of",
    "optimizer_params_of",
    "plain_name",
    "plan_groups",
    "plan_units",
    "refuse_whole_on_slices",
    "release",
    "state_of",
    "unwrap_compiled",
    "whole_shards",
    "with_whole_numel",
]
