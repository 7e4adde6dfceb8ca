"""Every hook zerokit puts on a model, registered in one place (``register_hooks``), each
handle kept in ``ShardState.hook_handles`` so that ``zerokit.unwrap`` can remove them all.
The sharding hooks below call ``ShardState``; the others call small functions that stay with
their concern: mixed-precision casts (``precision.py``), fp32-master state dicts
(``master_state.py``), buffer sync (``module.py``), names without ``_orig_mod.``
(``compiled.py``).

Hooks hold the state through a weak reference: the model owns its state (``model._zerokit``),
and a hook that held it strongly would close a cycle (model -> hooks -> state -> buckets ->
parameters), which only the garbage collector can free, late, after the process group.
Every entry point is ``@eager``: under ``torch.compile`` it runs as one opaque call, never
traced (``eager.py`` says why).

The same hooks are registered at every level; what differs is done by the objects
``core/build.py`` chose (``state.params``: whole or stage 3's sharded parameters;
``group.gradients``: full or sharded gradients). Which hook fires when, in one step (units
U1..Uk in forward order; R the model itself; "stage 3": only ``ShardedParams`` acts):

  forward   R pre-forward        -> state.root_pre_forward (mark the call; stage 3: gather
                                    R's own group, prefetch U1)
            Ui pre-forward       -> state.unit_pre_forward (stage 3: gather Ui, prefetch Ui+1;
                                    its tensor inputs pass through ``_PostBackward``)
            Ui forward           -> state.unit_post_forward (stage 3: free Ui); Ui's outputs
                                    get a gradient hook
            R forward            -> state.root_post_forward (agree the order of units); R's
                                    outputs get a gradient hook
  any time  M pre-forward        -> state.root_unit_used, for each module M holding root-unit
                                    parameters: gather the root unit if a backward freed it
                                    (stage 3: a tied head called on chunks outside R's forward)
            M pre-forward        -> stage 3 only, for each module M holding parameters of a
                                    unit U freed between uses: refuse (``NotGatheredError``
                                    naming M, U and why) if U is not gathered, i.e. M runs
                                    outside U's forward and would read empty parameters
  backward  R output gradient    -> state.begin_backward (queues the end-of-backward callback)
            parameter pre-gradient -> drop the ``GradPlaceholder`` the last backward published
            Ui output gradient   -> state.unit_pre_backward (stage 3: gather Ui, prefetch
                                    Ui-1)
            parameter gradient   -> state.grad_ready (group.gradients takes it; launch ready
                                    groups in order)
            Ui inputs' gradient  -> state.unit_post_backward (Ui's backward is over)
            end of backward      -> state._end_of_backward (launch the rest, agree which
                                    parameters hold a gradient, publish, free)
  state_dict / load_state_dict   -> StateDictHooks (the model's, a module sharing its
                                    parameters', a submodule's state_dict; only the outermost
                                    call acts) -> state.params.before_io / after_save /
                                    after_load (stage 3: the units gathered around it, then
                                    freed), the fp32 masters written
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..mixed_precision import MixedPrecision
from .compiled import add_inner_prefix, drop_inner_prefix
from .eager import eager
from .grad_placeholder import is_placeholder
from .group import UnitGroup
from .master_state import MasterStateDict
from .module import broadcast_module_state
from .params import ShardedParams
from .precision import cast_args, cast_output
from .state import ShardState


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the inputs' gradients are done."""

    @staticmethod
    def forward(ctx, state_ref, k: int, *inputs: torch.Tensor):
        ctx.state_ref, ctx.k = state_ref, k
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state_ref()
        if state is not None:
            group = state.groups[ctx.k]
            # called twice: another call's backward may still be pending
            state.unit_post_backward(group, ran_once=group.forward_calls == 1)
        return (None, None, *grads)


def register_hooks(
    model: nn.Module,
    state: ShardState,
    units: list[tuple[nn.Module, int]],
    *,
    policy: MixedPrecision,
    full_precision: list[tuple[nn.Module, torch.dtype]],
    sync_buffers: bool,
    outer: nn.Module,
) -> None:
    """Every hook zerokit adds, in this order, its handle into ``state.hook_handles``.

    ``units``: (module, index of its group) for every group except the root's;
    ``full_precision``: (module, its parameters' dtype) for each full-precision unit;
    ``outer``: what the user passed (a ``torch.compile`` wrapper around ``model``, or it)."""
    _register_sharding(model, state, units)
    handles = state.hook_handles
    masters = None
    if any(b.separate_masters for b in state.buckets):
        masters = MasterStateDict(model, state.buckets)
    state.state_dict_hooks = StateDictHooks(state, masters)
    state.state_dict_hooks.register(model)
    if sync_buffers:  # before every forward, rank 0's buffers go to every rank
        handles.append(
            model.register_forward_pre_hook(
                functools.partial(_sync_buffers, state.process_group)  # no reference to state
            )
        )
    handles += _precision_hooks(model, policy, full_precision)
    for module in outer.modules():  # no "_orig_mod." in state_dict names
        if isinstance(module, torch._dynamo.OptimizedModule):
            handles.append(module.register_state_dict_post_hook(drop_inner_prefix))
            handles.append(module.register_load_state_dict_pre_hook(add_inner_prefix))


def _sync_buffers(group, module, args) -> None:
    broadcast_module_state(module, group, params=False)


def _precision_hooks(model, policy: MixedPrecision, full_precision) -> list:
    if policy.param_dtype is None:
        return []
    handles = []
    if policy.cast_forward_inputs:
        hook = functools.partial(cast_args, policy.param_dtype)
        handles.append(model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
    if policy.output_dtype is not None:
        handles.append(
            model.register_forward_hook(functools.partial(cast_output, policy.output_dtype))
        )
    for module, dtype in full_precision:
        handles.append(
            module.register_forward_pre_hook(functools.partial(cast_args, dtype), with_kwargs=True)
        )
        handles.append(
            module.register_forward_hook(functools.partial(cast_output, policy.param_dtype))
        )
    return handles


def _register_sharding(
    model: nn.Module, state: ShardState, units: list[tuple[nn.Module, int]]
) -> None:
    ref = weakref.ref(state)
    handles = state.hook_handles
    for group in state.groups:
        for bucket in group.buckets:
            for param in bucket.params:
                handles.append(
                    param.register_hook(functools.partial(_drop_placeholder, weakref.ref(param)))
                )
                handles.append(
                    param.register_post_accumulate_grad_hook(functools.partial(_grad_ready, ref))
                )
    handles.append(model.register_forward_pre_hook(functools.partial(_root_pre_forward, ref)))
    handles.append(model.register_forward_hook(functools.partial(_root_post_forward, ref)))
    for module, k in units:
        handles.append(
            module.register_forward_pre_hook(
                functools.partial(_unit_pre_forward, ref, k), with_kwargs=True
            )
        )
        handles.append(module.register_forward_hook(functools.partial(_unit_post_forward, ref, k)))
    for module in _root_param_holders(model, state):
        handles.append(module.register_forward_pre_hook(functools.partial(_root_unit_used, ref)))
    for name, module, ks in _freed_unit_holders(model, state, units):
        hook = functools.partial(_unit_params_read, ref, name, ks)
        handles.append(module.register_forward_pre_hook(hook))


@eager
def _drop_placeholder(param_ref, grad: torch.Tensor) -> None:
    """Before autograd accumulates into ``param.grad``: a placeholder left by the last
    backward stands for gradients the group keeps itself, so autograd must start afresh."""
    param = param_ref()
    if param is not None and is_placeholder(param.grad):
        param.grad = None


def _root_param_holders(model: nn.Module, state: ShardState) -> list[nn.Module]:
    """Submodules holding parameters of the root unit themselves: a user may call them outside
    the model's forward (``model.lm_head(chunk)``), after a backward freed the root unit."""
    if state.root_group is None:
        return []
    owned = {id(p) for p in state.root_group.params}
    return [
        m
        for m in model.modules()
        if m is not model and any(id(p) in owned for p in m.parameters(recurse=False))
    ]


def _root_unit_used(ref, module, args) -> None:
    """Traced by torch.compile (not ``eager``): inside the model's forward the root unit is
    gathered, the check is a guard and the hook adds no graph break; only a call outside the
    forward after a backward freed the root unit runs the eager gather."""
    state = ref()
    if state is not None and not state.root_gathered:
        _gather_root(state)


@eager
def _gather_root(state: ShardState) -> None:
    state.root_unit_used()


def _freed_unit_holders(model: nn.Module, state: ShardState, units):
    """(name, module, indices of its units) for each module holding parameters of a unit that
    is freed between uses ('p_g_os'; not the root unit, not a unit kept whole) itself, besides
    the unit's own module (its pre-forward gathers it). Such a module runs inside its unit's
    forward, where the unit is gathered; called from anywhere else (a parent's forward
    reaching into the unit) it would read empty parameters."""
    own = {(id(module), k) for module, k in units}
    freed = {
        id(p): k
        for k, g in enumerate(state.groups)
        if g is not state.root_group and not g.keep_whole
        for b in g.buckets
        if b.shards_params
        for p in b.params
    }
    for name, module in model.named_modules():
        ks = {freed[id(p)] for p in module.parameters(recurse=False) if id(p) in freed}
        ks = {k for k in ks if (id(module), k) not in own}
        if ks:
            yield name, module, tuple(sorted(ks))


def _unit_params_read(ref, name: str, ks: tuple[int, ...], module, args) -> None:
    """Traced by torch.compile (not ``eager``), as ``_root_unit_used``: inside its unit's
    forward the unit is gathered and the check is a guard; only a call outside it takes the
    eager path, which raises."""
    state = ref()
    if state is not None and not all(state.groups[k].gathered for k in ks):
        _refuse_read(state, name, ks, module)


@eager
def _refuse_read(state: ShardState, name: str, ks: tuple[int, ...], module) -> None:
    group = next(state.groups[k] for k in ks if not state.groups[k].gathered)
    raise group.not_gathered(name, module)


@eager
def _grad_ready(ref, param: torch.Tensor) -> None:
    state = ref()
    if state is not None:
        state.grad_ready(param)


@eager
def _root_pre_forward(ref, module, args) -> None:
    state = ref()
    if state is not None:
        state.root_pre_forward()


@eager
def _root_post_forward(ref, module, args, output) -> None:
    state = ref()
    if state is None:
        return
    outputs = _grad_outputs(output)
    state.root_post_forward(graph=bool(outputs) and not state.in_backward)
    for tensor in outputs:
        tensor.register_hook(functools.partial(_begin_backward, ref))


@eager
def _begin_backward(ref, grad: torch.Tensor) -> None:
    state = ref()
    if state is not None:
        state.begin_backward()


@eager
def _unit_pre_forward(ref, k: int, module, args, kwargs):
    state = ref()
    if state is None:
        return None
    group: UnitGroup = state.groups[k]
    state.unit_pre_forward(group)
    if state.in_backward or not torch.is_grad_enabled():
        return None
    # Inputs that require grad pass through _PostBackward, whose backward says "Ui is done".
    flat, _ = tree_flatten((args, kwargs))
    needs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needs:
        return None
    passed = iter(_PostBackward.apply(ref, k, *needs))
    swap = {id(t): next(passed) for t in needs}
    return tree_map(
        lambda t: swap.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs)
    )


@eager
def _unit_post_forward(ref, k: int, module, args, output):
    state = ref()
    if state is None:
        return None
    group = state.groups[k]
    state.unit_post_forward(group)
    if torch.is_grad_enabled():
        for tensor in _grad_outputs(output):
            tensor.register_hook(functools.partial(_unit_pre_backward, ref, k))
    return None


@eager
def _unit_pre_backward(ref, k: int, grad: torch.Tensor) -> None:
    state = ref()
    if state is not None:
        state.unit_pre_backward(state.groups[k])


def _grad_outputs(output) -> list[torch.Tensor]:
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


class StateDictHooks:
    """``state_dict()`` / ``load_state_dict()`` of the wrapped model, of a module sharing its
    parameters under the same names (``share``: the LightningModule beside Lightning's root),
    and ``state_dict()`` of any submodule the user holds: full tensors, collectively, never
    stage 3's empty parameters (``state.params``: every unit or the submodule's units gathered
    around it, then freed) and, under mixed precision, the fp32 masters (``master_state.py``).

    Note: torch's ``state_dict()`` calls each child's ``state_dict()``, hooks and all. Only the
    outermost call acts (``_saving``, the module whose call is running); the calls it nests
    are part of it."""

    def __init__(self, state: ShardState, masters: MasterStateDict | None):
        self._ref = weakref.ref(state)  # the model owns the state, which owns these hooks
        self._masters = masters
        self._saving: nn.Module | None = None  # the module whose state_dict() is running
        self._inside: set[int] = set()  # its modules: their calls are nested in it

    def register(self, model: nn.Module) -> None:
        state = self._ref()
        self.share(model)
        if not isinstance(state.params, ShardedParams) and self._masters is None:
            return  # every rank holds every full parameter: a submodule's are there
        ids = _bucketed(state)
        for module in model.modules():
            if module is not model and any(id(p) in ids for p in module.parameters()):
                state.hook_handles += [
                    module.register_state_dict_pre_hook(self._before_save),
                    module.register_state_dict_post_hook(self._post_hook()),
                ]

    def share(self, module: nn.Module) -> None:
        """``module`` holds the wrapped model's parameters under its names: the same hooks."""
        self._ref().hook_handles += [
            module.register_state_dict_pre_hook(self._before_save),
            module.register_state_dict_post_hook(self._post_hook()),
            module.register_load_state_dict_pre_hook(self._before_load),
            module.register_load_state_dict_post_hook(self._after_load),
        ]

    def _post_hook(self):
        # torch tags a state-dict post hook with an attribute, which a bound method cannot take
        return functools.partial(StateDictHooks._after_save, self)

    def _before_save(self, module, prefix, keep_vars) -> None:
        state = self._ref()
        if state is None or (id(module) in self._inside and module is not self._saving):
            return  # nested in the outermost call, which gathered
        ids = {id(p) for p in module.parameters()}
        groups = [g for g in state.groups if any(id(p) in ids for p in g.params)]
        state.params.before_io(state, _call(module, "state_dict"), groups)
        # set once gathered: a call that raised there leaves nothing behind. (One that raised
        # after, inside torch's recursion, leaves a module that may start a call afresh.)
        self._saving, self._inside = module, {id(m) for m in module.modules()}

    def _after_save(self, module, state_dict, prefix, local_metadata) -> None:
        state = self._ref()
        if state is None or module is not self._saving:
            return
        self._saving, self._inside = None, set()
        state.params.after_save(state, state_dict)
        if self._masters is not None:
            self._masters.state_dict_hook(module, state_dict, prefix, local_metadata)

    def _before_load(self, module, *args) -> None:
        state = self._ref()
        if state is not None:
            state.params.before_io(state, _call(module, "load_state_dict"))
            if self._masters is not None:
                self._masters.load_hook(module, *args)

    def _after_load(self, module, incompatible_keys) -> None:
        state = self._ref()
        if state is not None:
            state.params.after_load(state)


def _bucketed(state: ShardState) -> set[int]:
    return {id(p) for bucket in state.buckets for p in bucket.params}


def _call(module: nn.Module, method: str) -> str:
    """The call as the user wrote it, for the bounded wait's message."""
    if hasattr(module, "_zerokit"):
        return f"model.{method}()"
    return f"{type(module).__name__}.{method}()"
