"""What the engine trains: the :class:`Task` contract, task lookup by name, and shared losses.

A task bundles everything that is specific to one kind of experiment -- the model builder, the
data builder, the loss, the batch keys, the FLOP count, the config schema of its ``model`` and
``data`` sections, which of its fields may change on resume, which parameters skip weight
decay, and how its eval metrics are summarized -- so the engine (everything in
``goat_jax/train/``) never imports a model or a dataset and names no field of any family.

Tasks live outside the engine, one module per experiment family, each exposing a module-level
``TASK`` (a :class:`Task`) built with ordinary imports:

* ``goat_jax/tasks/lm.py``   -- language modelling (``config.task = 'lm'``).
* ``goat_jax/tasks/<name>.py`` -- any other family (``config.task = '<name>'``).
* a user module anywhere on ``sys.path``: ``config.task = 'my_pkg.my_tasks:CLASSIFIER'``.

:func:`get_task` imports the module named by ``config.task`` and returns its attribute; nothing
is registered by import side effect, so a run's ``config.json`` names everything needed to load
it again in a fresh process (:func:`goat_jax.train.run.load_run`).

The contract, in one place:

``loss(apply_fn, params, batch, rng) -> (loss_sum, (weight_sum, aux_sums))``
    ``loss_sum``: an *unnormalized* float32 scalar sum (e.g. over tokens or examples) and
    ``weight_sum`` its weight; the engine divides by the global batch's total weight, which keeps
    gradient accumulation and sharding exact. ``aux_sums``: a dict of float32 scalar *sums*
    (e.g. ``{'correct': sum of 1[argmax == label] * w}``) that eval adds up over the whole eval
    set and hands to ``eval_metrics``; ``{}`` when there are none. ``rng`` is a per-step PRNG key
    in training (``fold_in(key(config.seed), step)``, then one per microbatch: dropout,
    drop-path, mixup) and ``None`` in evaluation, where the loss must be deterministic.
    ``apply_fn`` is ``model.apply``: call ``apply_fn({'params': params}, *inputs, rngs=...)``.
``eval_metrics(totals) -> {name: value}``
    ``totals``: ``{'loss': summed loss, 'weight': summed weight, **summed aux}`` as Python floats
    over the eval set. The engine always writes ``eval_loss = loss / weight``; each returned
    ``name`` is written as ``eval_<name>`` next to it (metrics.jsonl and TensorBoard), e.g.
    ``{'accuracy': totals['correct'] / totals['weight']}``.
``resume_safe_fields``
    dotted config fields of the task's sections (``'data.read_threads'``, ``'model.remat'``)
    that may change between a run and its resumption without changing what is computed; the
    engine's own are declared per field (``resume=`` in :data:`goat_jax.train.validation.ENGINE`)
    and collected in :data:`goat_jax.train.checkpoint.RESUME_SAFE_FIELDS`.
``no_decay_names``
    parameter (or module) names whose leaves get no weight decay, besides every array with fewer
    than two dimensions (the rule is :func:`goat_jax.train.optim.decay_mask`).
``decay_groupings``
    other weight-decay groupings the task offers, ``{name: params -> pytree of bools}`` (True =
    decayed), chosen with ``config.optimizer.decay_grouping`` (optional field; 'default' or
    absent: the ``no_decay_names`` rule above), usually one of the optimizer's rules applied to
    the task's names (:func:`goat_jax.train.optim.substring_decay_mask`,
    :func:`goat_jax.train.optim.decay_everything`).

Adding a family: docs/training.md, section "Adding an experiment family".
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from typing import Any, Callable, Dict, FrozenSet, Iterator, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from goat_jax.config.fields import Section, specs_of
from goat_jax.kernels import plan as plan_lib
from goat_jax.losses import softmax_cross_entropy, weighted_cross_entropy  # noqa: F401 -- the tasks' shared losses
from goat_jax.train import validation

Batch = Dict[str, Any]

# Where built-in tasks live: config.task = 'lm' loads goat_jax.tasks.lm:TASK.
BUILTIN_PACKAGE = "goat_jax.tasks"


# The attention plan's fields of a config's ``model`` section, declared once for every task
# (:meth:`goat_jax.kernels.plan.AttentionPlan.from_config` reads them, with the top-level
# ``context_strategy`` and ``context_load_balance``). They are the plan's, not the model's: the
# entry point builds the plan once and hands it to ``build_model``; the models hold no copy.
PLAN_FIELDS = plan_lib.config_fields()


@dataclasses.dataclass(frozen=True)
class Datasets:
    """What a task's data builder returns.

    ``train``: infinite iterator of this host's numpy batches with ``get_state()`` (JSON) and
    ``set_state(state)``; ``make_eval``: returns a fresh finite iterator of this host's eval
    batches, or is None; ``info``: task-specific extras (e.g. the tokenizer).
    """

    train: Iterator[Batch]
    make_eval: Optional[Callable[[], Iterator[Batch]]]
    info: Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TaskFields:
    """Every config field a task declares, in one object: the engine derives the task's schema
    (which names each section takes), the types and ranges it checks before any work, and the
    defaults a config may leave out, all from these declarations (the engine's own fields are
    declared the same way, in :data:`goat_jax.train.validation.ENGINE`).

    Attributes:
      model: the ``model`` section's declarations: its config dataclass (``LMConfig``,
        ``ViTConfig``, each field declared once with ``goat_jax.config.fields.declare`` /
        ``borrow``: default, type, range, doc), or a :class:`goat_jax.config.fields.Section`
        (``name=(default, Field)``); a config may leave out any field that has a default.
      data: ``{name: Section or {field: Field}}``, the fields of each data pipeline the task
        reads (one entry for a task with one pipeline). The schema is their union; a config is
        checked against the one ``data_source(config)`` names.
      data_source: ``config -> key of data`` (default: the first).
      top_level: the task's own top-level fields, which every config sets (``{'seq_len': Int(min=1)}``).
      model_extra: model fields outside the dataclass (the ViT's ``preset``).
      model_name: what ``model.name`` held in checkpoints written before the task alone chose
        the model ('' for none); the field is accepted (deprecated) and never added.
      data_defaults: ``{'data.field': default}`` of data fields a config may leave out (runs
        written before the field existed resume under this value).
      plan_fields: the fields of :data:`PLAN_FIELDS` (the attention plan's) the ``model``
        section takes, next to the model's own.
    """

    model: Any
    data: Dict[str, Any]
    data_source: Optional[Callable[[Any], str]] = None
    top_level: Dict[str, Any] = dataclasses.field(default_factory=dict)
    model_extra: Dict[str, Any] = dataclasses.field(default_factory=dict)
    model_name: str = ""
    data_defaults: Dict[str, Any] = dataclasses.field(default_factory=dict)
    plan_fields: Tuple[str, ...] = tuple(PLAN_FIELDS.specs)

    def __post_init__(self):
        unknown = sorted(set(self.plan_fields) - set(PLAN_FIELDS.specs))
        if unknown:
            raise ValueError(f"TaskFields.plan_fields: {unknown} are not fields of the attention plan "
                             f"({sorted(PLAN_FIELDS.specs)}).")

    def schema(self) -> Dict[str, set]:
        """``{section: field names}`` of the task's sections (``model``, ``data``)."""
        model = ({f.name for f in dataclasses.fields(self.model)} if dataclasses.is_dataclass(self.model)
                 else set(_specs(self.model)))
        model |= set(self.plan_fields)
        return {"model": model | set(self.model_extra) | ({"name"} if self.model_name else set()),
                "data": set().union(*(set(_specs(d)) for d in self.data.values()))}

    def specs(self, config: Any) -> Dict[str, Dict[str, Any]]:
        """``{section: {field: Field}}`` checked on ``config`` ('' for the top level): the
        model's declarations, the data pipeline the config chooses, the top-level fields."""
        source = self.data_source(config) if self.data_source else next(iter(self.data))
        plan = {name: PLAN_FIELDS.specs[name] for name in self.plan_fields}
        return {"": dict(self.top_level), "model": {**_specs(self.model), **plan, **self.model_extra},
                "data": _specs(self.data[source])}

    def defaults(self) -> Dict[str, Any]:
        """``{'section.field': default}``: the model section's defaults, ``data_defaults`` and
        ``model.name``; what a config that leaves the field out computes with."""
        out = {f"model.{name}": value for name, value in _defaults(self.model).items()}
        out.update({f"model.{name}": PLAN_FIELDS.default(name) for name in self.plan_fields})
        out.update(self.data_defaults)
        if self.model_name:
            out["model.name"] = self.model_name
        return out


def _specs(declared: Any) -> Dict[str, Any]:
    """``{field: Field}`` of a config dataclass, a :class:`goat_jax.config.fields.Section` or a
    plain ``{field: Field}`` mapping."""
    if dataclasses.is_dataclass(declared):
        return specs_of(declared)
    if isinstance(declared, Section):
        return declared.specs
    return dict(declared)


def _defaults(declared: Any) -> Dict[str, Any]:
    """``{field: default}`` of the fields of ``declared`` (as :func:`_specs`) that have one."""
    if dataclasses.is_dataclass(declared):
        return {f.name: f.default for f in dataclasses.fields(declared) if f.default is not dataclasses.MISSING}
    if isinstance(declared, Section):
        return declared.default_values()
    return {}


@dataclasses.dataclass(frozen=True)
class Task:
    """The task-specific half of a training run (the contract is in this module's docstring).

    Attributes:
      name: a readable name for logs (``config.task`` is what loads it).
      batch_keys: keys every batch holds (checked on the first batch).
      build_model: ``(config, plan) -> nn.Module``: the model of ``config`` whose attention runs
        under ``plan`` (the run's :class:`goat_jax.kernels.plan.AttentionPlan`, which the entry point
        builds once with ``AttentionPlan.from_config(config)`` and hands to the engine too); a
        task never builds a plan itself.
      make_datasets: ``(config, global_batch_size, process_index, process_count, *, plan) ->
        Datasets``; each process gets its own ``global_batch_size / process_count`` rows;
        ``plan`` as above (the packers honour its document bound, ``plan.document_bound()``).
      loss: ``(apply_fn, params, batch, rng) -> (loss_sum, (weight_sum, aux_sums))``.
      dummy_batch: ``(config, batch_size) -> numpy batch`` of the training shapes (for init and
        benchmarks; only ``batch_keys`` matter).
      model_inputs: ``batch -> positional args of model.apply`` (used for ``init``).
      tokens_per_example: ``config -> int``, for tokens/s (1 for one-label examples).
      flops_per_token: ``config -> float`` training FLOPs per token (forward + backward) for MFU,
        or None when unknown.
      fields: the task's config fields (:class:`TaskFields`): its schema, types, ranges and
        defaults, declared once.
      validate: ``config -> None``; raises ValueError naming the field (cross-field rules, e.g.
        length limits; types and ranges are checked before, from ``fields``).
      eval_metrics: ``totals -> {name: value}``, written as ``eval_<name>``.
      resume_safe_fields: dotted task fields that may change on resume.
      no_decay_names: parameter/module names excluded from weight decay.
      decay_groupings: named alternative decay masks (``optimizer.decay_grouping``).
    """

    name: str
    batch_keys: Tuple[str, ...]
    build_model: Callable[[Any, Any], Any]
    make_datasets: Callable[..., Datasets]
    loss: Callable[..., Tuple[jax.Array, Tuple[jax.Array, Dict[str, jax.Array]]]]
    dummy_batch: Callable[[Any, int], Batch]
    model_inputs: Callable[[Batch], Sequence[Any]]
    tokens_per_example: Callable[[Any], int]
    flops_per_token: Callable[[Any], Optional[float]]
    fields: TaskFields
    validate: Callable[[Any], None] = lambda config: None
    eval_metrics: Callable[[Dict[str, float]], Dict[str, float]] = lambda totals: {}
    resume_safe_fields: Tuple[str, ...] = ()
    no_decay_names: FrozenSet[str] = frozenset()
    decay_groupings: Dict[str, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)


def field_defaults(task: "Task") -> Dict[str, Any]:
    """``{'section.field': default}`` of every field a config may leave out, the engine's
    (:func:`goat_jax.train.validation.engine_defaults`) and ``task``'s
    (:meth:`TaskFields.defaults`): absent and default are the same run, so a checkpoint resumes
    across a config that adds or drops a field at its default
    (:meth:`goat_jax.train.checkpoint.Checkpointer.check_compatible`)."""
    return {**validation.engine_defaults(), **task.fields.defaults()}


# Deprecated fields a config may still carry but that a filled-in config must not gain.
_NOT_FILLED = frozenset({"model.name"})


def _missing_fields(config: Any, task: "Task", sections: Optional[set] = None) -> Iterator[Tuple[Any, str, Any]]:
    """``(parent ConfigDict, field name, default)`` of each field of ``task.fields.defaults()``
    that ``config`` lacks, in the sections the config has (only ``sections`` if given)."""
    for dotted, default in task.fields.defaults().items():
        section, _, name = dotted.rpartition(".")
        if dotted in _NOT_FILLED or not section or section not in config:
            continue
        if sections is not None and section not in sections:
            continue
        if name not in config[section]:
            yield config[section], name, default


def with_field_defaults(config: Any, task: "Task") -> Any:
    """A copy of ``config`` (an ml_collections ConfigDict) as the run computes with it: every
    engine field it leaves out at its default (:func:`goat_jax.train.validation.with_engine_defaults`)
    and every field of ``task.fields.defaults()`` it lacks (for configs written before the
    field existed: an old run's ``config.json``, an old config file), the same defaults that
    :class:`goat_jax.train.checkpoint.Checkpointer` treats as "no change" on resume. Only task
    fields of sections the config has are added; ``config`` itself is not modified."""
    filled = validation.with_engine_defaults(config)
    for parent, name, default in list(_missing_fields(filled, task)):
        parent[name] = default
    return filled


_CLI_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def add_model_defaults(config: Any) -> Any:
    """Adds to ``config.model`` (in place; returns ``config``) every model field of the config's
    task that the config file leaves out, at its default, so that any model field can be set
    with ``--config.model.<field>=<value>`` or an override, not only those the file lists. A
    default of None becomes a typed placeholder (from the field's declared kind) so that the
    command line can still set it; a None field with no plain type is left out. Field references
    of the file are kept (the config is not copied). A config without ``task`` or ``model``, or
    with an unknown task (validation names it later), is returned unchanged."""
    if "task" not in config or "model" not in config:
        return config
    try:
        task = get_task(config.task)
    except ValueError:
        return config
    from ml_collections import config_dict  # pylint: disable=g-import-not-at-top  # configs only

    specs = task.fields.specs(config).get("model", {})
    for parent, name, default in list(_missing_fields(config, task, {"model"})):
        if default is None:
            kind = _CLI_TYPES.get(getattr(specs.get(name), "kind", None))
            if kind is None:
                continue
            default = config_dict.placeholder(kind)
        parent[name] = default
    return config


def builtin_tasks() -> Tuple[str, ...]:
    """Names of the task modules in ``goat_jax/tasks/`` (the accepted short ``config.task``)."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    return tuple(sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")))


def get_task(name: Any) -> Task:
    """The :class:`Task` named by ``config.task``.

    ``'lm'`` (no dot or colon) imports ``goat_jax.tasks.lm`` and returns its ``TASK``;
    ``'pkg.module:ATTR'`` imports ``pkg.module`` and returns ``ATTR``; ``'pkg.module'`` returns
    its ``TASK``. Raises ValueError naming ``config.task`` and the choices otherwise.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"config.task={name!r} must name a task: one of {builtin_tasks()}, or "
                         "'package.module:ATTR' for a Task defined elsewhere.")
    module_name, _, attr = name.partition(":")
    if "." not in module_name and not attr:
        module_name = f"{BUILTIN_PACKAGE}.{module_name}"
    attr = attr or "TASK"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ValueError(f"config.task={name!r}: no module {module_name!r}. Built-in tasks: "
                             f"{builtin_tasks()}; a task elsewhere is 'package.module:ATTR'.") from None
        raise  # the task module exists but one of its own imports is missing
    task = getattr(module, attr, None)
    if not isinstance(task, Task):
        raise ValueError(f"config.task={name!r}: {module_name}.{attr} is "
                         f"{'missing' if task is None else type(task).__name__}, not a "
                         "goat_jax.train.tasks.Task.")
    check_contract(task, name)
    return task


# How the engine calls each callable of the contract: its spelling, and placeholder arguments.
_CALLS = {"build_model": ("build_model(config, plan)", (None, None), {}),
          "make_datasets": ("make_datasets(config, global_batch_size, process_index, process_count, *, plan)",
                            (None, 1, 0, 1), {"plan": None})}


def check_contract(task: Task, name: str) -> None:
    """Raises ValueError naming ``config.task`` and the callable when ``task`` cannot be called
    the way the engine calls it (:data:`_CALLS`): e.g. a task written before ``build_model``
    took the run's plan (``build_model(config)`` -> ``build_model(config, plan)``)."""
    for field, (spelled, args, keywords) in _CALLS.items():
        try:
            inspect.signature(getattr(task, field)).bind(*args, **keywords)
        except TypeError as err:
            raise ValueError(f"config.task={name!r}: its {field} cannot be called as {spelled} ({err}); the "
                             "engine passes the run's attention plan (goat_jax.train.tasks.Task).") from None
        except ValueError:  # a builtin without a signature: called as it is
            continue


# ----------------------------------------------------------------------------------------------
# Shared losses (softmax_cross_entropy and weighted_cross_entropy are goat_jax/losses.py's,
# imported above: the models compute their loss with them too, and models never import the engine)
# ----------------------------------------------------------------------------------------------


def weighted_correct(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum_i w_i * 1[argmax logits_i == targets_i]`` in float32: the top-1 accuracy's numerator
    (an aux sum; divide by the summed weight in ``eval_metrics``). Shapes as
    :func:`weighted_cross_entropy`."""
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(hit * weights.astype(jnp.float32))
